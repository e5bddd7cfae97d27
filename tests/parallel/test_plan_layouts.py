"""``lockstep plan`` for the layouts of #17: pipeline schedules and their bubble, the embedding copy
of MTP / tied heads, context parallel (and ep spanning it), the trainer's refusals, fake-PG
verification through lockstep's own stage parallelizer, and the ``dsv3-mtp-pp`` recipes."""

import pytest

from lockstep.models.registry import model_config
from lockstep.parallel.plan import Layout, build_plan, cmd_plan, verify_fsdp
from lockstep.parallel.plan.build import pipeline_bubble
from lockstep.parallel.plan.cli import plan_from_args


def test_pipeline_bubble_per_schedule():
    # GPipe / 1F1B: (pp-1) / (M + pp-1); Interleaved (2 stages per rank): (pp-1) / (2M + pp-1)
    assert pipeline_bubble("1F1B", 4, 8)["fraction"] == pytest.approx(3 / 11)
    assert pipeline_bubble("GPipe", 4, 8)["fraction"] == pytest.approx(3 / 11)
    assert pipeline_bubble("Interleaved1F1B", 4, 8)["fraction"] == pytest.approx(3 / 19)
    # zero-bubble V schedules idle 0 when forward, input-grad and weight-grad take equal time
    assert pipeline_bubble("ZBVZeroBubble", 4, 8)["fraction"] == 0.0
    assert pipeline_bubble("DualPipeV", 4, 8)["fraction"] == 0.0
    assert pipeline_bubble("1F1B", 1, 1)["fraction"] == 0.0
    plan = build_plan(model_config("llama3", "debug"), Layout(world=2, pp=2), seq_len=64)
    assert plan.microbatches == 2 and plan.to_dict()["batch"]["pipeline_bubble"]["fraction"] == pytest.approx(1 / 3)


def test_v_schedule_places_first_and_last_stage_on_rank_0():
    cfg = model_config("deepseek_v3", "debug").replace(n_layers=4)
    plan = build_plan(cfg, Layout(world=2, pp=2), seq_len=64, batch_size=4, pp_schedule="ZBVZeroBubble")
    assert [s.layers for s in plan.stages] == [[range(0, 1), range(3, 4)], [range(1, 2), range(2, 3)]]
    kinds = {p.kind for p in plan.stages[0].params}
    assert {"embedding", "head", "mtp"} <= kinds and "embedding_copy" not in kinds  # no copy: one rank holds both
    assert not [c for c in plan.stages[0].collectives if c.group == "pp first+last"]
    # 1F1B on the same model: the last stage copies the embedding and all-reduces its gradient once a step
    plan = build_plan(cfg, Layout(world=2, pp=2), seq_len=64)
    last = plan.stages[1]
    copy = next(p for p in last.params if p.kind == "embedding_copy")
    assert copy.name == "tok_embeddings.weight"
    shared = [c for s in plan.stages for c in s.collectives if c.group == "pp first+last"]
    assert len(shared) == 2 and all(c.calls_per_step == 1 and c.bytes_per_call == copy.numel * 4 for c in shared)


def test_context_parallel_splits_activations_and_reduces_grads_over_cp():
    cfg = model_config("qwen3", "debug")
    one = build_plan(cfg, Layout(world=1), seq_len=64)
    cp = build_plan(cfg, Layout(world=2, cp=2), seq_len=128)  # same tokens per rank as `one`
    assert cp.worst.activation_bytes == pytest.approx(one.worst.activation_bytes)
    assert cp.worst.param_bytes == one.worst.param_bytes  # parameters replicated over cp
    ops = {(c.op, c.group) for c in cp.worst.collectives}
    assert ("all-gather", "cp") in ops and ("reduce-scatter", "cp") in ops and ("all-reduce", "cp") in ops
    ring = build_plan(cfg, Layout(world=2, cp=2), seq_len=128, cp_method="ring")
    assert ("send", "cp") in {(c.op, c.group) for c in ring.worst.collectives}
    # ep spanning dp_shard x cp: experts whole on each rank, not FSDP-sharded, not reduced over cp
    plan = build_plan(model_config("qwen3_moe", "debug"), Layout(world=4, dp_shard=2, cp=2, ep=4), seq_len=64)
    assert plan.layout.ep_spans_cp and plan.layout.expert_fsdp == 1
    experts = [p for p in plan.params if p.kind == "experts"]
    assert experts and all(p.fsdp == 1 and p.local_shape(0)[0] == p.shape[0] // 4 for p in experts)
    cp_grads = [c for c in plan.worst.collectives if c.group == "cp" and c.op == "all-reduce"]
    assert cp_grads and not any("experts" in c.what for c in cp_grads)


def test_layouts_the_trainer_refuses_are_sized_with_its_reason():
    # ep dividing dp_shard while cp > 1: the planner sizes it, lockstep wants ep == dp_shard x cp
    plan = build_plan(model_config("qwen3_moe", "debug"), Layout(world=8, dp_shard=4, cp=2, ep=2), seq_len=64)
    assert any("lockstep's trainer refuses this layout today: parallel.ep" in n for n in plan.notes)
    plan = build_plan(model_config("llama3", "debug"), Layout(world=4, pp=2, tp=2), seq_len=64)
    assert not any("refuses" in n for n in plan.notes)


@pytest.mark.parametrize("argv, path", [
    ("--recipe debug-deepseek --world 2 --tp 2", "parallelize_dense"),  # MLA + expert TP + MTP
    ("--recipe debug-moe --world 4 --tp 2 --dp-shard 2 --ep 2", "parallelize_dense"),
    ("--recipe debug-moe --world 4 --dp-replicate 2 --dp-shard 2 --ep 2", "parallelize_dense"),  # HSDP x EP
    ("--recipe debug-moe --world 4 --cp 2 --dp-shard 2 --ep 4", "parallelize_dense"),  # ep over dp_shard x cp
    ("--recipe debug-qwen3 --world 4 --cp 2 --tp 2", "parallelize_dense"),
    ("--recipe debug-qwen35-moe --world 4 --dp-shard 2 --tp 2", "parallelize_dense"),  # DeltaNet heads
    ("--recipe debug-qwen3 --world 4 --pp 2 --tp 2", "stage_parallelizer"),  # tied head copy on stage 1
    ("--recipe debug-deepseek --world 8 --pp 2 --dp-shard 2 --ep 2 --tp 2", "stage_parallelizer"),
    ("--family llama3 --flavor tiny --world 4 --pp 2 --dp-shard 2 --pp-schedule Interleaved1F1B --seq-len 64 "
     "--batch-size 4", "stage_parallelizer"),
])
def test_verify_fsdp_through_lockstep_for_the_new_layouts(argv, path):
    plan, config, _ = plan_from_args(argv.split())
    result = verify_fsdp(plan, config)
    assert result["ok"], result["mismatches"][:5]
    assert result["path"].endswith(path) and not result["lockstep_path_skipped_reason"]
    assert result["n_match"] == result["n_params"] == len(plan.stages[result["stage"]].params)
    assert result["local_numel"] == result["plan_numel"] == plan.rank_param_numel(result["rank"])


def test_dsv3_mtp_pp_recipe_plans_and_verifies(capsys):
    from lockstep.recipes import get_recipe

    for name in ("dsv3-mtp-pp-671b", "qwen3-moe-64k-cp"):  # planning recipes: valid configs too
        get_recipe(name).config().validate()
    cfg = get_recipe("dsv3-mtp-pp").config()
    cfg.validate()
    par = cfg.parallel.resolve(8)
    assert (par.pp, par.dp_shard, par.ep, cfg.model.n_mtp) == (2, 4, 2, 1)
    assert cmd_plan(["--recipe", "dsv3-mtp-pp", "--world", "8", "--verify-fsdp"]) == 0
    out = capsys.readouterr().out
    assert "split_into_stages + stage_parallelizer" in out and "MISMATCH" not in out
    assert "refuses" not in out


@pytest.mark.parametrize("world, extra", [(256, []), (512, ["--ep", "64", "--batch-size", "2048"])])
def test_dsv3_671b_rows_fit_an_80_gib_gpu(world, extra):
    # the update's rows: DeepSeek-V3 671B + MTP1, PP2 x EP x FSDP, full activation checkpointing
    plan, _, _ = plan_from_args(["--recipe", "dsv3-mtp-pp-671b", "--world", str(world)] + extra)
    assert plan.total_params > 670e9 and plan.layout.pp == 2 and plan.microbatches == 8
    assert plan.worst.total_bytes < 80 * 2**30
    assert plan.bubble["fraction"] == pytest.approx(1 / 9)
    assert plan.layout.expert_fsdp == 4
    assert not any("refuses" in n for n in plan.notes)


def test_long_context_cp_row_and_the_recurrence_refusal():
    from lockstep.config.base import ConfigError

    # Qwen3.5's Gated DeltaNet layers are refused under cp with the trainer's own message
    with pytest.raises(ConfigError, match=r"--cp: parallel.cp: .*layers.0.attention is a GatedDeltaNet"):
        plan_from_args(["--family", "qwen3_5", "--flavor", "35B-A3B", "--world", "40", "--cp", "8",
                        "--seq-len", "65536"])
    plan, _, _ = plan_from_args(["--recipe", "qwen3-moe-64k-cp", "--world", "40"])
    L = plan.layout
    assert (L.cp, L.dp_shard, plan.seq_len) == (4, 10, 65536) and not any("refuses" in n for n in plan.notes)
    assert plan.worst.total_bytes < 80 * 2**30
    assert {("all-gather", "cp"), ("all-reduce", "cp")} <= {(c.op, c.group) for c in plan.worst.collectives}


def test_matrix_columns_and_refusals_come_from_the_code():
    from lockstep.parallel.plan.matrix import COMBOS, _refusal, combo_of

    assert combo_of(4, {"pp": 2, "dp_shard": 2, "ep": 2}) == "pp x ep"
    assert combo_of(4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}) == "hsdp x ep"
    assert combo_of(4, {"dp_shard": 2, "cp": 2, "ep": 4}) == "ep over dp_shard x cp"
    assert combo_of(2, {"dp_replicate": 2, "dp_shard": 1}) == "hsdp"
    assert "GatedDeltaNet" in _refusal("qwen3_5", COMBOS["cp"])
    assert "needs MoE layers" in _refusal("llama3", COMBOS["ep"])
    assert _refusal("deepseek_v3", COMBOS["pp x dp_shard x ep"]) == ""
