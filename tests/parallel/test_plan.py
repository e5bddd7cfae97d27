"""``lockstep plan``: per-rank sizes from a meta-device build, named errors, fake-PG verification."""

import json
import math

import pytest

from lockstep.config.base import ConfigError
from lockstep.models.registry import model_config
from lockstep.parallel.plan import Layout, build_meta_model, build_plan, cmd_plan, layer_ranges, verify_fsdp


@pytest.fixture(scope="module")
def llama8b():
    cfg = model_config("llama3", "8B")
    return cfg, build_meta_model(cfg)


@pytest.fixture(scope="module")
def dsv3():
    cfg = model_config("deepseek_v3", "671B")
    return cfg, build_meta_model(cfg)


def _all_finite(obj) -> bool:
    if isinstance(obj, dict):
        return all(_all_finite(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_all_finite(v) for v in obj)
    if isinstance(obj, float):
        return math.isfinite(obj)
    return True


def _rank_sum(plan, unique: bool = False) -> int:
    return sum(plan.rank_param_numel(r, unique) for r in range(plan.layout.world))


def test_llama3_8b_fsdp8_holds_an_eighth_per_rank(llama8b):
    cfg, model = llama8b
    plan = build_plan(cfg, Layout(world=8, dp_shard=8), seq_len=4096, param_dtype="bf16", model=model)
    total_bytes = plan.total_params * 2
    assert plan.total_params == sum(p.numel() for p in model.parameters())
    stage = plan.worst
    assert stage.param_bytes == pytest.approx(total_bytes / 8, rel=1e-6)
    assert stage.grad_bytes == pytest.approx(plan.total_params * 4 / 8, rel=1e-6)  # fp32 grads
    assert stage.optimizer_bytes == pytest.approx(plan.total_params * 12 / 8, rel=1e-6)  # 2 moments + master
    for rank in range(8):
        assert plan.rank_param_bytes(rank) == pytest.approx(total_bytes / 8, abs=8 * 2)
    assert _rank_sum(plan) == plan.total_params
    ops = {(c.op, c.group) for c in stage.collectives}
    assert ops == {("all-gather", "dp_shard"), ("reduce-scatter", "dp_shard")}


def test_deepseek_v3_671b_on_256_ranks(dsv3):
    cfg, model = dsv3
    plan = build_plan(cfg, Layout(world=256, pp=8, ep=32, dp_shard=32), seq_len=4096, model=model)
    assert plan.total_params > 670e9
    assert [s.layers for s in plan.stages] == [[r] for r in layer_ranges(61, 8)]
    assert [len(r) for r in layer_ranges(61, 8)] == [8] * 5 + [7] * 3
    for s in plan.stages:
        assert 0 < s.param_bytes < 64 * 2**30 and s.activation_bytes > 0 and math.isfinite(s.total_bytes)
    # each rank holds 256 / 32 = 8 routed experts per MoE layer, unsharded by FSDP (dp_shard / ep = 1)
    experts = next(p for p in plan.stages[1].params if p.name == "layers.8.feed_forward.experts.w1")
    assert experts.local_shape(0) == (8, 2048, 7168) and experts.fsdp == 1
    d = plan.to_dict()
    json.dumps(d, allow_nan=False)
    assert _all_finite(d)
    ops = {c.op for c in plan.worst.collectives}
    assert {"all-gather", "reduce-scatter", "all-to-all", "send", "recv"} <= ops
    # every parameter element is held exactly once across the 256 ranks, but the embedding, which the
    # last stage copies for the MTP head
    assert _rank_sum(plan, unique=True) == plan.total_params
    assert _rank_sum(plan) == plan.total_params + cfg.vocab_size * cfg.dim


@pytest.mark.parametrize("family, flavor, layout", [
    ("llama3", "debug", Layout(world=16, dp_replicate=2, dp_shard=4, tp=2)),
    ("qwen3_moe", "debug", Layout(world=16, pp=2, dp_shard=4, tp=2, ep=2)),
    ("deepseek_v3", "debug", Layout(world=24, pp=3, dp_shard=8, ep=4)),
    ("qwen3", "debug", Layout(world=6, dp_shard=3, tp=2)),  # uneven FSDP pieces, tied embeddings
    ("qwen3", "debug", Layout(world=8, pp=2, dp_shard=2, tp=2)),  # tied head: the last stage's embedding copy
    ("deepseek_v3", "debug", Layout(world=8, pp=2, dp_replicate=2, dp_shard=2, ep=2)),  # HSDP x EP, MTP copy
    ("qwen3", "debug", Layout(world=8, cp=2, dp_shard=2, tp=2)),  # cp replicates the parameters
    ("qwen3_moe", "debug", Layout(world=8, cp=2, dp_shard=4, ep=8)),  # ep spans dp_shard x cp: experts whole
])
def test_rank_totals_add_up_to_the_model(family, flavor, layout):
    cfg = model_config(family, flavor)
    plan = build_plan(cfg, layout, seq_len=64, batch_size=layout.resolve().dp * max(layout.pp, 1))
    L = plan.layout
    # counted once each, the pieces of all ranks are exactly the model
    assert _rank_sum(plan, unique=True) == plan.total_params
    # as held: every HSDP replica and cp rank holds a copy (not of experts that ep splits over cp), every
    # TP rank a copy of the TP-replicated parameters, the last stage a copy of the embedding (MTP, tied head)
    held = sum(p.numel * L.dp_replicate * (1 if p.ep > 1 and L.ep_spans_cp else L.cp) * (L.tp if p.tp_dim is None else 1)
               for p in plan.params)
    assert _rank_sum(plan) == held
    copies = [p for p in plan.params if p.kind == "embedding_copy"]
    assert len(copies) == (1 if L.pp > 1 and (cfg.tie_embeddings or getattr(cfg, "n_mtp", 0)) else 0)
    # the padded per-rank numbers never undercount the exact pieces
    for s in plan.stages:
        assert s.param_numel >= s.param_numel_exact


@pytest.mark.parametrize("kwargs, layout, match", [
    ({}, Layout(world=256, pp=8, dp_shard=16), r"--world: pp=8 x dp_replicate=1 x dp_shard=16 x cp=1 x tp=1 = 128"),
    ({}, Layout(world=250, pp=8), r"--world: 250 is not divisible by pp=8"),
    ({}, Layout(world=256, pp=8, ep=3), r"--ep: 3 does not divide --dp-shard=32"),
    ({}, Layout(world=256, pp=8, ep=64, dp_shard=32), r"--ep: 64 does not divide --dp-shard=32"),
    ({}, Layout(world=8, tp=0), r"--tp: must be >= 1"),
    ({}, Layout(world=8, dp_shard=0), r"--dp-shard: must be >= 1 or -1"),
    ({}, Layout(world=256, pp=64, dp_shard=4), r"--pp: 61 layers cannot be split into 64 pipeline stages"),
    ({"batch_size": 100}, Layout(world=256, pp=8), r"--batch-size: 100 is not a positive multiple of the 32"),
    ({"microbatches": 4, "batch_size": 256}, Layout(world=256, pp=8), r"--microbatches: .*1F1B needs n_microbatches >= pp = 8"),
    ({"seq_len": 10**6}, Layout(world=256, pp=8), r"--seq-len: 1000000 exceeds model.max_seq_len"),
    ({}, Layout(world=256, pp=8, tp=3, dp_shard=-1), r"--world: 256 is not divisible by pp=8 x dp_replicate=1 x cp=1 x tp=3"),
    ({}, Layout(world=48, pp=2, tp=3, dp_shard=8), r"--tp: 3 does not divide model.n_heads=128"),
])
def test_invalid_degrees_name_the_degree(dsv3, kwargs, layout, match):
    cfg, model = dsv3
    args = {"seq_len": 4096} | kwargs
    with pytest.raises(ConfigError, match=match):
        build_plan(cfg, layout, model=model, **args)


def test_model_specific_degree_errors():
    with pytest.raises(ConfigError, match=r"--ep: 2 > 1 but llama3 debug has no routed experts"):
        build_plan(model_config("llama3", "debug"), Layout(world=2, ep=2), seq_len=64)
    with pytest.raises(ConfigError, match=r"--ep: 16 does not divide n_routed_experts=8"):
        build_plan(model_config("qwen3_moe", "debug"), Layout(world=16, ep=16), seq_len=64)
    with pytest.raises(ConfigError, match=r"--tp: 4 does not divide model.n_kv_heads=2"):
        build_plan(model_config("llama3", "debug"), Layout(world=4, tp=4), seq_len=64)
    with pytest.raises(ConfigError, match=r"--cp: --seq-len=66 must be divisible by 2 x cp = 4"):
        build_plan(model_config("llama3", "debug"), Layout(world=2, cp=2), seq_len=66)
    with pytest.raises(ConfigError, match=r"--ep: 4 does not divide --dp-shard=2 and is not dp_shard x cp = 8"):
        build_plan(model_config("qwen3_moe", "debug"), Layout(world=8, cp=4, ep=4), seq_len=64)
    with pytest.raises(ConfigError, match=r"--pp: 2 layers cannot be split into 3 pipeline stages"):
        build_plan(model_config("llama3", "debug"), Layout(world=3, pp=3), seq_len=64)


def test_layout_coords_round_trip():
    layout = Layout(world=96, pp=2, dp_replicate=2, dp_shard=8, tp=3, ep=4).resolve()
    seen = set()
    for rank in range(96):
        c = layout.coords(rank)
        assert c["dp_shard"] == c["dp_shard_mod_ep"] * 4 + c["ep"]
        seen.add((c["pp"], c["dp_replicate"], c["dp_shard"], c["tp"]))
    assert len(seen) == 96
    assert layout.coords(layout.first_rank_of_stage(1))["pp"] == 1


def test_activation_checkpointing_shrinks_activations(llama8b):
    cfg, model = llama8b
    act = {ac: build_plan(cfg, Layout(world=8), seq_len=4096, activation_checkpoint=ac,
                          model=model).worst.activation_bytes for ac in ("none", "selective", "full")}
    assert act["full"] < act["selective"] < act["none"]
    # 1F1B: stage s keeps min(M, pp - s) micro-batches in flight
    plan = build_plan(cfg, Layout(world=8, pp=4), seq_len=4096, model=model)
    assert [s.in_flight_microbatches for s in plan.stages] == [4, 3, 2, 1]


def test_pipeline_split_matches_lockstep_pipeline():
    pipeline = pytest.importorskip("lockstep.parallel.pipeline")
    for n, pp in ((61, 8), (32, 4), (7, 3), (5, 5)):
        assert layer_ranges(n, pp) == pipeline.layer_ranges(n, pp)


def test_cmd_plan_json(capsys):
    assert cmd_plan(["--family", "qwen3_moe", "--flavor", "debug", "--world", "8", "--ep", "2", "--tp", "2",
                     "--seq-len", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == {"world": 8, "pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 2, "ep": 2, "cp": 1, "dp": 4,
                             "expert_fsdp": 2, "ep_spans_cp": False, "cp_method": "allgather"}
    assert out["worst_stage"]["collectives"] and out["worst_stage"]["param_bytes"] > 0
    assert cmd_plan(["--recipe", "debug", "--world", "4"]) == 0
    assert "llama3 debug on 4 ranks" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--world"):
        cmd_plan(["--recipe", "debug"])


def test_verify_fsdp_through_lockstep_parallelize(capsys):
    # pp = ep = 1 and a dense model: lockstep's own ParallelDims.build_mesh + parallelize_dense (TP + FSDP)
    assert cmd_plan(["--family", "llama3", "--flavor", "debug", "--world", "8", "--tp", "2",
                     "--seq-len", "64", "--verify-fsdp"]) == 0
    out = capsys.readouterr().out
    assert "via lockstep ParallelDims.build_mesh + parallelize_dense" in out
    assert "21 parameters, 21 local shard shapes match the plan" in out


def test_verify_fsdp_deepseek_v3_671b_on_256_ranks(dsv3):
    cfg, model = dsv3
    plan = build_plan(cfg, Layout(world=256, pp=8, ep=32, dp_shard=32), seq_len=4096, model=model)
    result = verify_fsdp(plan, cfg)
    assert result["ok"], result["mismatches"][:5]
    assert result["stage"] == plan.worst.stage and result["rank"] == 32 * plan.worst.stage
    assert result["n_params"] == len(plan.worst.params) == result["n_match"]
    assert result["local_numel"] == result["plan_numel"] == plan.rank_param_numel(result["rank"])
    w1 = next(e for e in result["examples"] if e["name"].endswith("experts.w1"))
    # lockstep's own stage parallelizer: the rank's 8 experts are local tensors, kept out of FSDP
    assert w1["local_shape"] == [8, 2048, 7168]
    assert result["path"] == "lockstep ParallelDims.build_mesh + split_into_stages + stage_parallelizer"


def test_verify_fsdp_expert_parallel_matches_the_plan():
    # lockstep's own EP path where its ParallelConfig accepts the layout, the torchtitan-style mesh otherwise
    cfg = model_config("qwen3_moe", "debug")
    for layout in (Layout(world=4, ep=4), Layout(world=8, ep=2)):
        plan = build_plan(cfg, layout, seq_len=64)
        result = verify_fsdp(plan, cfg)
        assert result["ok"], (result["path"], result["mismatches"][:5])
        assert result["local_numel"] == plan.rank_param_numel(0)
