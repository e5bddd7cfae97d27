"""Pipeline parallelism: stage cutting, layout validation, and training parity with one process.

The slow tests spawn gloo workers (``file://`` rendezvous) that train llama3 debug for 5 fp32 AdamW
steps with each schedule and compare the losses with one process training the same weights on the
same batches: max abs diff <= 1e-5 (the layouts only reorder fp32 sums: micro-batch losses and
gradients add up in a different order, which moves losses of ~8 by ~1e-6; measured: FSDP
resharding after forward under ZBV gave 2e-4 at step 2 and 5e-3 by step 5). AdamW all but hides
a uniformly wrong gradient scale in the losses (grads / n_microbatches moved them by only 2.4e-5),
so the clipped-before grad norms are compared too, at 1e-4 (torch's fp32 ``vector_norm`` of a
sharded 131k-element head gradient is off by ~3e-5 relative against float64), plus the final
weights (1e-4) and eval losses before and after training (1e-5). Activation checkpointing rides
along in two cases (selective under the split-backward V schedules is refused up front). The
workers also count host synchronisations (a tensor read back as a Python number) inside
``PipelineRunner.step`` after the first step (whose one-time shape exchange torch does with CPU
object collectives): there must be none (the loss stays a tensor until the step's reduction).
"""

import contextlib

import dataclasses
import datetime
import json
import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.grad import clip_grad_norm
from lockstep.parallel.pipeline import (
    SCHEDULES,
    PipelineStageModule,
    layer_ranges,
    split_into_stages,
    stage_ids_for_rank,
    validate_pipeline,
)

STEPS, BATCH, SEQ, LR, MAX_NORM = 5, 8, 32, 1e-3, 1.0
# (name, schedule, n_layers, n_microbatches, grad_accum, activation_checkpoint): multi-stage
# schedules need 2 x pp = 4 layers (llama3 debug has 2); grad_accum=2 runs each step as two half
# batches with loss_scale=1/2
CASES = [
    ("1F1B", "1F1B", 2, 4, 1, "none"),
    ("GPipe", "GPipe", 2, 4, 1, "none"),
    ("Interleaved1F1B", "Interleaved1F1B", 4, 4, 1, "none"),
    ("ZBVZeroBubble", "ZBVZeroBubble", 4, 4, 1, "none"),
    ("DualPipeV", "DualPipeV", 4, 4, 1, "none"),
    ("Interleaved1F1B grad_accum=2 + selective AC", "Interleaved1F1B", 4, 2, 2, "selective"),
]
# pp=2 x dp_shard=2 (world 4): each dp rank pipelines its half of the batch
FSDP_CASES = [
    ("pp2xdp2 1F1B", "1F1B", 2, 2, 1, "none"),
    ("pp2xdp2 Interleaved1F1B", "Interleaved1F1B", 4, 2, 1, "none"),
    ("pp2xdp2 ZBVZeroBubble", "ZBVZeroBubble", 4, 2, 1, "none"),
    ("pp2xdp2 DualPipeV", "DualPipeV", 4, 4, 1, "none"),
    ("pp2xdp2 ZBVZeroBubble grad_accum=2 + full AC", "ZBVZeroBubble", 4, 2, 2, "full"),
]


def _config(n_layers):
    return dataclasses.replace(model_config("llama3", "debug"), n_layers=n_layers)


def _batches(vocab):
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _optimizer(params):
    return torch.optim.AdamW(list(params), lr=LR, weight_decay=0.1, fused=True)


# ---------------------------------------------------------------- fast: cutting and validation


def test_layer_ranges_split_evenly_by_count():
    assert layer_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert [len(r) for r in layer_ranges(10, 4)] == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="pp"):
        layer_ranges(2, 4)


def test_stages_chain_to_the_full_model_exactly():
    cfg = _config(4)
    model = build_model(cfg, seed=0)
    stages = split_into_stages(model, 3)
    assert [list(s.layers.keys()) for s in stages] == [["0", "1"], ["2"], ["3"]]
    assert stages[0].tok_embeddings is not None and stages[0].norm is None and stages[0].output is None
    assert stages[1].tok_embeddings is None and stages[1].norm is None and stages[1].output is None
    assert stages[2].tok_embeddings is None and stages[2].norm is not None and stages[2].output is not None
    # FQNs are the model's; every parameter lives on exactly one stage, as a copy
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    full = dict(model.named_parameters())
    for s in stages:
        for n, p in s.named_parameters():
            assert torch.equal(p, full[n]) and p.data_ptr() != full[n].data_ptr()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    h = tokens
    for s in stages:
        h = s(h)
    assert torch.equal(h, model(tokens))
    only_last = split_into_stages(model, 3, stage_ids=[2])
    assert len(only_last) == 1 and isinstance(only_last[0], PipelineStageModule) and only_last[0].is_last


def test_too_few_layers_names_pp():
    model = build_model(model_config("llama3", "debug"), seed=0)  # 2 layers
    with pytest.raises(ValueError, match=r"^pp: 2 layers cannot be split into 4"):
        split_into_stages(model, 4)
    with pytest.raises(ValueError, match=r"^pp: 2 layers"):
        validate_pipeline("Interleaved1F1B", 2, 4, n_layers=2)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_selective_checkpointing_is_refused_under_split_backward(schedule):
    from lockstep.parallel.checkpointing import apply_activation_checkpointing
    from lockstep.parallel.pipeline import check_split_backward

    parts = split_into_stages(build_model(_config(4), seed=0), 4, stage_ids=[0, 3])
    check_split_backward([apply_activation_checkpointing(p, "full") for p in parts], schedule)
    parts = [apply_activation_checkpointing(p, "selective") for p in parts]
    message = rf"^pp: selective activation checkpointing \(layers.0\) cannot run under {schedule}"
    with pytest.raises(ValueError, match=message):
        check_split_backward(parts, schedule)


def test_stage_placement():
    assert stage_ids_for_rank("1F1B", 1, 2) == [1]
    assert [stage_ids_for_rank("Interleaved1F1B", r, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids_for_rank("ZBVZeroBubble", r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_ids_for_rank("dualpipev", r, 2) for r in range(2)] == [[0, 3], [1, 2]]


@pytest.mark.parametrize("schedule, pp, n_microbatches", [
    ("1F1B", 2, 1), ("1F1B", 4, 3), ("Interleaved1F1B", 2, 5), ("Interleaved1F1B", 2, 7),
    ("Interleaved1F1B", 4, 9), ("DualPipeV", 2, 3), ("DualPipeV", 4, 7), ("GPipe", 2, 0),
])
def test_bad_microbatch_counts_name_n_microbatches(schedule, pp, n_microbatches):
    with pytest.raises(ValueError, match=r"^n_microbatches: "):
        validate_pipeline(schedule, pp, n_microbatches)


@pytest.mark.parametrize("schedule, pp, n_microbatches", [
    ("1F1B", 2, 2), ("GPipe", 4, 1), ("Interleaved1F1B", 2, 3), ("Interleaved1F1B", 2, 6),
    ("Interleaved1F1B", 4, 10), ("ZBVZeroBubble", 2, 1), ("DualPipeV", 2, 4), ("DualPipeV", 2, 5),
])
def test_good_microbatch_counts_pass(schedule, pp, n_microbatches):
    assert validate_pipeline(schedule, pp, n_microbatches) == schedule


def test_batch_and_schedule_errors():
    with pytest.raises(ValueError, match=r"^n_microbatches: 3 does not divide the per-rank batch size 8"):
        validate_pipeline("GPipe", 2, 3, batch_size=8)
    with pytest.raises(ValueError, match="pp_schedule"):
        validate_pipeline("Looped", 2, 2)
    assert set(SCHEDULES) == {"1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", "GPipe"}


# ---------------------------------------------------------------- slow: training parity


def _reference(n_layers):
    """Single-process losses, grad norms and final weights of the full-batch mean loss."""
    cfg = _config(n_layers)
    model = build_model(cfg, seed=0)
    opt = _optimizer(model.parameters())
    losses, norms = [], []
    for inputs, targets in _batches(cfg.vocab_size):
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        norms.append(float(clip_grad_norm(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def _count_host_syncs(counter: list):
    """Count tensor -> Python number reads (``item``, ``tolist``, ``float``, ``int``, ``bool``) while open."""
    names = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def spy(original):
        def counted(self, *a, **k):
            counter.append(original.__name__)
            return original(self, *a, **k)
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, spy(original))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _worker(rank, world, init_file, out_dir, cases, fsdp):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    from lockstep.parallel.checkpointing import apply_activation_checkpointing
    from lockstep.parallel.fsdp import apply_fsdp
    from lockstep.parallel.pipeline import PipelineRunner

    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
        pp_group, dp_mesh = mesh["pp"], mesh["dp_shard"]
        dp_rank, dp = dp_mesh.get_local_rank(), 2
    else:
        pp_group, dp_mesh, dp_rank, dp = dist.group.WORLD, None, 0, 1
    results = {}
    for name, schedule, n_layers, n_mb, accum, ac in cases:
        def parallelize(part, ac=ac):  # parallelize_dense's order: AC, then FSDP over the dp sub-mesh
            apply_activation_checkpointing(part, ac)
            if dp_mesh is not None:
                apply_fsdp(part, list(part.layers.values()), dp_mesh, "float32", "always")

        try:
            model = build_model(_config(n_layers), seed=0)
            runner = PipelineRunner(model, pp_group, schedule=schedule, n_microbatches=n_mb,
                                    parallelize_fn=parallelize)
            del model
            opt = _optimizer(runner.parameters())
            batches = _batches(_config(n_layers).vocab_size)
            eval_batch = [t[:BATCH // dp] for t in batches[0]]
            # evaluate before training too (the trainer does): eval -> train -> eval mode switches
            initial_eval = runner.broadcast_loss(runner.eval_loss(*eval_batch))
            losses, norms, syncs = [], [], []
            for i, (inputs, targets) in enumerate(batches):
                size = BATCH // dp // accum
                loss = 0.0
                for a in range(accum):
                    rows = slice((dp_rank * accum + a) * size, (dp_rank * accum + a + 1) * size)
                    with _count_host_syncs(syncs) if i else contextlib.nullcontext():
                        step_loss = runner.step(inputs[rows], targets[rows], loss_scale=1 / accum)
                    loss += runner.broadcast_loss(step_loss)
                loss /= accum
                if fsdp:  # mean of the dp ranks' (equal-sized) batch means = the global mean
                    t = torch.tensor(loss, dtype=torch.float64)
                    dist.all_reduce(t, group=dp_mesh.get_group())
                    loss = float(t) / dp
                norms.append(float(runner.clip_grad_norm(MAX_NORM)))
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss)
            eval_loss = runner.broadcast_loss(runner.eval_loss(*eval_batch))
            state = runner.full_state_dict()
            if rank == 0:
                torch.save(state, os.path.join(out_dir, f"{name}.pt"))
            results[name] = {"losses": losses, "norms": norms, "eval": eval_loss, "initial_eval": initial_eval,
                             "parts": [sorted(p.layers.keys()) for p in runner.model_parts], "syncs": syncs,
                             "step_loss": None if step_loss is None else [str(step_loss.dtype), step_loss.dim()]}
        except Exception as e:  # report, and keep the other ranks from waiting on this one forever
            import traceback

            results[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
            dist.destroy_process_group()
            sys.stdout.flush()
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
            os._exit(1)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _spawn(tmp_path, world, cases, fsdp, timeout=150):
    import torch.multiprocessing as mp

    out = tmp_path / "out"
    out.mkdir()
    ctx = mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(out), cases, fsdp), nprocs=world,
                   join=False)
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                failure = f"workers still running after {timeout}s (hang)"
                break
    except Exception as e:  # a worker exited non-zero: its own report (below) says why
        failure = f"{type(e).__name__}: {e}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = {}
    for r in range(world):
        path = out / f"rank{r}.json"
        results[r] = json.loads(path.read_text()) if path.exists() else {}
    return failure, results, out


def _check(name, n_layers, results, out, references, world):
    """Problems with one case (an empty list when it matches the single process)."""
    errors = {r: res[name]["error"] for r, res in results.items() if "error" in res.get(name, {})}
    if errors:
        return [f"{name}: {errors}"]
    if not all(name in res for res in results.values()):
        return [f"{name}: no result from ranks {[r for r, res in results.items() if name not in res]}"]
    problems = []
    ref_losses, ref_norms, ref_state = references[n_layers]
    for r in range(world):
        got = results[r][name]
        loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref_losses))
        norm_diff = max(abs(a - b) for a, b in zip(got["norms"], ref_norms))
        if len(got["losses"]) != STEPS or loss_diff > 1e-5:
            problems.append(f"{name} rank {r}: losses {got['losses']} vs {ref_losses} (max diff {loss_diff:.2e})")
        if norm_diff > 1e-4:
            problems.append(f"{name} rank {r}: grad norms {got['norms']} vs {ref_norms}")
        if got["syncs"]:  # PipelineRunner.step read a tensor back to the host
            problems.append(f"{name} rank {r}: host synchronisations inside PipelineRunner.step: {got['syncs']}")
        if got["step_loss"] not in (None, ["torch.float64", 0]):  # a detached 0-d tensor (last stage), else None
            problems.append(f"{name} rank {r}: PipelineRunner.step returned {got['step_loss']}")
        print(f"{name} rank {r}: max |loss diff| {loss_diff:.2e}, max |grad-norm diff| {norm_diff:.2e}, "
              f"stage layers {got['parts']}")
    state = torch.load(out / f"{name}.pt")
    if sorted(state) != sorted(ref_state):
        return problems + [f"{name}: full_state_dict keys {sorted(state)} != {sorted(ref_state)}"]
    weight_diff = max(float((state[k] - ref_state[k]).abs().max()) for k in ref_state)
    if weight_diff > 1e-4:
        problems.append(f"{name}: final weights differ by {weight_diff:.2e}")
    eval_diff = 0.0
    for key, weights in (("initial_eval", None), ("eval", ref_state)):
        model = build_model(_config(n_layers), seed=0)
        if weights is not None:
            model.load_state_dict(weights)
        with torch.no_grad():
            inputs, targets = (t[:BATCH * 2 // world] for t in _batches(model.config.vocab_size)[0])
            ref_eval = float(F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))
        got = [results[r][name][key] for r in range(world)]
        eval_diff = max(eval_diff, *(abs(g - ref_eval) for g in got))
        if eval_diff > 1e-5:
            problems.append(f"{name}: {key} {got} vs {ref_eval}")
    print(f"{name}: max |weight diff| after {STEPS} steps {weight_diff:.2e}, eval loss diff {eval_diff:.2e}")
    return problems


def _run_and_check(tmp_path, world, cases, fsdp):
    # one spawn per test: the module's cases share the workers' start-up, and nothing depends on
    # xdist keeping tests together (its loadgroup does not group them on this pytest)
    references = {n: _reference(n) for n in sorted({c[2] for c in cases})}
    failure, results, out = _spawn(tmp_path, world, cases, fsdp)
    problems = [p for name, _, n_layers, *_ in cases for p in _check(name, n_layers, results, out, references, world)]
    assert failure is None and not problems, (failure, problems)


@pytest.mark.slow
@pytest.mark.xdist_group("parallel")
def test_pp2_every_schedule_matches_one_process(tmp_path):
    _run_and_check(tmp_path, 2, CASES, fsdp=False)


@pytest.mark.slow
@pytest.mark.xdist_group("parallel")
def test_pp2_x_fsdp2_matches_one_process(tmp_path):
    """pp=2 x dp_shard=2: FSDP2 shards each stage's blocks and root over the dp sub-mesh."""
    _run_and_check(tmp_path, 4, FSDP_CASES, fsdp=True)
