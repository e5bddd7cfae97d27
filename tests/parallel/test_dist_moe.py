"""Dist-MoE (lockstep.parallel.dist_moe): chunked overlap, capacity, drops, event order, metrics.

One spawn per world (2 and 4, gloo, one thread per rank) runs every case and the tests read its
results. Each rank trains on its own 2 x 16 tokens; qwen3_moe and deepseek_v3 debug flavors (8
experts, top-2; deepseek_v3 with a shared expert and sigmoid routing), fp32 and bf16 autocast.

Bitwise claims (``torch.equal``): ep_chunks 2 and 4 vs 1 (losses of 2 AdamW steps, every gradient
of step 0, every rank), no-drop vs a capacity factor large enough that nothing drops, no-drop vs the
synchronous uneven exchange (ep_chunks=0, fp32; measured equal, see its test), ep_chunks=4 with
and without full activation checkpointing, and ep_chunks 1 and 4 with and without the emulated link
(``LOCKSTEP_EP_LINK_EMULATION``; its waits must cover the emulated latency). Drops: a known small
example and the same input twice give the same drop set. A plan's layout: only real rows on the
wire, split sizes agreeing between ranks, owner groups padded only up to 16 rows. A recorded
timeline shows the overlap's order; a short ``lockstep train`` run shows the metrics and manifest
entry.
"""

import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lockstep.checkpoint.train_state import clean_fqn
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.checkpointing import apply_activation_checkpointing
from lockstep.parallel.dist_moe import DistMoE
from lockstep.parallel.dist_moe_ops import LINK_ENV, Recorder, record_timeline
from lockstep.parallel.dist_moe_plan import make_plan
from lockstep.parallel.expert import apply_expert_parallel, sync_expert_parallel_grads

STEPS = 2
FAMILIES = ("qwen3_moe", "deepseek_v3")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LINK_LATENCY_S = 0.005  # emulated per-exchange latency: far above a debug-model exchange's real wait
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]


def _batches(vocab, rank):
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (2, 17), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _train(family, dtype, ep_chunks, capacity_factor=0.0, timeline=False, checkpoint=False):
    cfg = model_config(family, "debug")
    model = apply_expert_parallel(build_model(cfg, seed=0), ep_chunks=ep_chunks, capacity_factor=capacity_factor)
    if checkpoint:  # the recompute re-runs the exchanges; the backward uses the forward's own state
        apply_activation_checkpointing(model, "full")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses, grads, metrics, events = [], None, [], None
    for inputs, targets in _batches(cfg.vocab_size, dist.get_rank()):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            if timeline:
                with record_timeline() as events:
                    logits = model(inputs)
                    aux, m = model.pop_auxiliary()
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) + sum(aux.values())
                    loss.backward()
                timeline = False
            else:
                logits = model(inputs)
                aux, m = model.pop_auxiliary()
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) + sum(aux.values())
                loss.backward()
        metrics.append({k: float(v) for k, v in m.items()})
        sync_expert_parallel_grads(model)
        losses.append(loss.detach())
        if grads is None:
            grads = {clean_fqn(n): p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist_moe = [isinstance(m, DistMoE) for m in model.modules() if hasattr(m, "routing_mode")]
    return {"losses": losses, "grads": grads, "metrics": metrics, "events": events,
            "dist_moe": bool(dist_moe) and all(dist_moe) == bool(ep_chunks)}


def _same(a, b):
    assert a["dist_moe"] and b["dist_moe"]  # each run used the path it asked for
    return all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"])) and \
        sorted(a["grads"]) == sorted(b["grads"]) and all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])


def _max_diff(a, b):
    loss = max(float((x - y).abs()) for x, y in zip(a["losses"], b["losses"]))
    grad = max(float((a["grads"][n] - b["grads"][n]).abs().max()) for n in a["grads"])
    return loss, grad


def _known_drops(rank, world):
    """4 tokens, top-1, one expert per rank, capacity ceil(0.5 * 4 * 1 / world) per (source, expert):
    within each expert the earliest tokens keep their slots."""
    ids = torch.tensor([[0], [0], [world - 1], [0]]) if rank == 0 else torch.tensor([[1], [1], [1], [0]])
    plan = make_plan(ids, 1, 1, dist.group.WORLD, 0.5, Recorder(0))
    return {"capacity": plan.capacity, "dropped": plan.dropped, "mine": plan.dropped_assignments().tolist()}


def _layout(rank, world):
    """A no-drop plan of 40 tokens, top-2, 2 experts per rank, 2 chunks (routing seeded per rank)."""
    g = torch.Generator().manual_seed(7 + rank)
    ids = torch.stack([torch.randperm(2 * world, generator=g)[:2] for _ in range(40)])
    plan = make_plan(ids, 2, 2, dist.group.WORLD, 0.0, Recorder(0))
    return {"counts": plan.counts, "send": [c.send_splits for c in plan.chunks],
            "recv": [c.recv_splits for c in plan.chunks], "sent": [c.assignment for c in plan.chunks],
            "owner": [(c.owner_index, c.owner_rows, c.group_offsets, c.kept_local) for c in plan.chunks]}


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    res = {"overlap": {}, "capacity": {}, "legacy": {}}
    bases = {}
    for family in FAMILIES:
        for dname, dtype in DTYPES.items():
            base = bases[family, dname] = _train(family, dtype, 1)
            for chunks in (2, 4):
                run = _train(family, dtype, chunks, timeline=(family, dname, chunks) == ("qwen3_moe", "fp32", 4))
                res["overlap"][family, dname, chunks] = _same(base, run)
                if run["events"] is not None:
                    res["events"] = run["events"]
                    res["metrics"] = run["metrics"]
            if dname == "fp32":
                res.setdefault("checkpoint", {})[family] = _same(run, _train(family, dtype, 4, checkpoint=True))
                res["capacity"][family] = _same(base, _train(family, dtype, 1, capacity_factor=float(world * 8)))
                legacy = _train(family, dtype, 0)
                assert legacy["dist_moe"]
                res["legacy"][family] = _max_diff(base, legacy)
    # an emulated link of 5 ms latency and 1 TB/s: only sleeps are added, so the bits stay
    os.environ[LINK_ENV] = f"{LINK_LATENCY_S * 1e6:g},1e6"
    try:
        linked = {c: _train("qwen3_moe", torch.float32, c, timeline=True) for c in (1, 4)}
    finally:
        del os.environ[LINK_ENV]
    res["link_same"] = {c: _same(bases["qwen3_moe", "fp32"], run) for c, run in linked.items()}
    res["link_metrics"] = linked[1]["metrics"]
    res["link_events"] = {c: run["events"] for c, run in linked.items()}
    # drops: twice the same input, the same drop set; a known small example
    drops = [_train("qwen3_moe", torch.float32, 2, capacity_factor=0.5) for _ in range(2)]
    res["drop_repeat"] = _same(*drops)
    res["drop_metrics"] = drops[0]["metrics"]
    res["known_drops"] = _known_drops(rank, world)
    res["layout"] = _layout(rank, world)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _spawn(computed_once, world):
    tmp = computed_once(f"dist-moe spawn world {world}", lambda d: mp.spawn(
        _worker, args=(world, str(d / "init"), str(d)), nprocs=world, join=True))
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def results(request, computed_once):
    return request.param, _spawn(computed_once, request.param)


def test_overlap_is_bitwise_equal_to_no_overlap(results):
    """ep_chunks 2 and 4 vs 1: losses and every gradient torch.equal, both families, fp32 and bf16."""
    world, ranks = results
    for rank, res in enumerate(ranks):
        assert len(res["overlap"]) == len(FAMILIES) * len(DTYPES) * 2
        bad = [case for case, same in res["overlap"].items() if not same]
        assert not bad, (world, rank, bad)


def test_no_drop_capacity_equals_bigger_capacity_bitwise(results):
    """No-drop vs a capacity factor of 8 x world (a capacity nothing reaches): bitwise equal."""
    _, ranks = results
    for res in ranks:
        assert all(res["capacity"].values()) and len(res["capacity"]) == len(FAMILIES), res["capacity"]


def test_no_drop_equals_the_synchronous_exchange(results):
    """No-drop vs ExpertParallelExperts' uneven exchange (ep_chunks=0), fp32: equal bits on these
    shapes (measured: the expert matmuls are other calls, so this is not guaranteed by construction;
    a change here on another CPU would show as a difference of ~1e-7, still far below 1e-5)."""
    _, ranks = results
    for res in ranks:
        for family, (loss, grad) in res["legacy"].items():
            assert loss == 0.0 and grad == 0.0, (family, loss, grad)


def test_activation_checkpointing_is_bitwise_equal(results):
    """ep_chunks=4 under full activation checkpointing (the recompute runs the exchanges again) vs
    without: bitwise equal, fp32."""
    _, ranks = results
    for res in ranks:
        assert all(res["checkpoint"].values()) and len(res["checkpoint"]) == len(FAMILIES), res["checkpoint"]


def test_emulated_link_keeps_bits_and_shows_in_the_waits(results):
    """Under LOCKSTEP_EP_LINK_EMULATION (5 ms per exchange): ep_chunks 1 and 4 bitwise equal to
    ep_chunks 1 without it; in the recorded timeline (step 0) no exchange's wait returns before its
    issue + 5 ms. With ep_chunks=1 almost nothing runs between issue and wait, so the exposed-wait
    metric holds most of the latency: at least half of exchanges x 5 ms (2 layers: step 0's forward
    2 x 2 exchanges; step 1's report 2 x 4 with step 0's backward; half, because a loaded host may
    deschedule the main thread between issue and wait), and the plan's blocking gather (one per
    layer and forward) a full latency each."""
    _, ranks = results
    for res in ranks:
        assert res["link_same"] == {1: True, 4: True}, res["link_same"]
        for chunks, events in res["link_events"].items():
            issue = {(k, layer, c): t0 for e, k, layer, c, t0, _ in events if e == "issue"}
            waited = {(k, layer, c): t1 for e, k, layer, c, _, t1 in events if e == "wait"}
            assert sorted(issue) == sorted(waited) and len(issue) == 2 * 4 * chunks, (chunks, sorted(issue))
            late = [key for key in issue if waited[key] < issue[key] + LINK_LATENCY_S]
            assert not late, (chunks, late)
        first, second = res["link_metrics"]
        for m, exchanges in ((first, 4), (second, 8)):
            assert m["moe/dispatch_wait_s"] + m["moe/combine_wait_s"] >= exchanges * LINK_LATENCY_S / 2, m
            assert m["moe/sync_wait_s"] >= 2 * LINK_LATENCY_S, m


def test_drops_are_deterministic_and_counted(results):
    world, ranks = results
    for rank, res in enumerate(ranks):
        assert res["drop_repeat"]
        dropped = [m["layers.0.feed_forward/dropped_tokens"] for m in res["drop_metrics"]]
        assert all(d > 0 for d in dropped), dropped
        assert res["drop_metrics"][0]["moe/dropped_tokens"] >= dropped[0]
        known = res["known_drops"]
        assert known["capacity"] == -(-2 // world)  # ceil(0.5 * 4 * 1 / world)
        # rank 0 sends tokens 0, 1, 3 to expert 0 and 2 to the last; the others 0, 1, 2 to expert 1 and 3
        # to expert 0: with one slot per (source, expert) the first token of each keeps it
        assert known["mine"] == ([1, 3] if rank == 0 else [1, 2]), known
        assert known["dropped"] == 2 * world


def test_exchanges_carry_only_real_rows(results):
    """No-drop plan: every assignment is sent exactly once, sorted by expert; what rank r sends to d
    is what d expects from r; the owner pads an expert's group only up to 16 rows (ROW_TILE, fp32)
    and every received row lands in its expert's group, in (source, position) order."""
    world, ranks = results
    for r, res in enumerate(ranks):
        lay = res["layout"]
        sent = torch.cat(lay["sent"])
        assert torch.equal(sent.sort().values, torch.arange(80))  # 40 tokens x top-2, each once
        for c in range(2):
            for d in range(world):
                assert lay["send"][c][d] == ranks[d]["layout"]["recv"][c][r]
            owner_index, owner_rows, offsets, kept = lay["owner"][c]
            n = kept.sum(0)
            assert sum(lay["recv"][c]) == owner_index.numel() == int(n.sum())
            groups = offsets.diff(prepend=torch.zeros(1, dtype=offsets.dtype))
            assert torch.equal(groups.long(), torch.where(n > 0, n.clamp(min=16), 0)) and int(offsets[-1]) == owner_rows
            # received layout (source, expert, position) -> owner rows: each expert's rows contiguous
            expert_of = torch.repeat_interleave(torch.arange(2).repeat(world), kept.flatten())
            starts = offsets.long() - groups.long()
            for e in range(2):
                rows = owner_index[expert_of == e]
                assert torch.equal(rows, torch.arange(int(starts[e]), int(starts[e]) + int(n[e])))


def test_no_drop_metrics(results):
    _, ranks = results
    for res in ranks:
        m = res["metrics"][1]
        for name in ("dispatch_wait_s", "combine_wait_s", "sync_wait_s", "hidden_frac", "imbalance", "dropped_tokens"):
            assert f"moe/{name}" in m and f"layers.0.feed_forward/{name}" in m, sorted(m)
        assert m["moe/dropped_tokens"] == 0.0
        assert m["layers.0.feed_forward/imbalance"] >= 1.0
        assert 0.0 <= m["moe/hidden_frac"] <= 1.0 and m["moe/dispatch_wait_s"] > 0


def test_next_dispatch_is_issued_before_the_experts_finish(results):
    """The recorded timeline (ep_chunks=4): chunk k+1's dispatch is issued before chunk k's experts
    finish, chunk k's combine before chunk k+1's experts start; in backward (reverse order) chunk
    k-1's output gradients are issued before chunk k's expert backward finishes."""
    _, ranks = results
    for res in ranks:
        ev = res["events"]
        issue = {(k, layer, c): t0 for e, k, layer, c, t0, _ in ev if e == "issue"}
        compute = {(k, layer, c): (t0, t1) for e, k, layer, c, t0, t1 in ev if e == "compute"}
        assert {c for (_, _, c) in issue} == {0, 1, 2, 3}
        for layer in (0, 1):
            for c in range(3):
                assert issue["dispatch", layer, c + 1] < compute["experts", layer, c][1]
                assert issue["combine", layer, c] < compute["experts", layer, c + 1][0]
            for c in (3, 2, 1):
                assert issue["combine_bwd", layer, c - 1] < compute["experts_bwd", layer, c][1]


def test_cli_run_reports_metrics_and_manifest(tmp_path):
    """``lockstep train --parallel.ep 2 --parallel.ep-chunks 2`` (torchrun, 2 ranks, 3 steps): the
    moe/ metrics and the per-layer ones reach metrics.jsonl, the operation the manifest."""
    import json
    import subprocess

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "lockstep.cli", "train", "--recipe", "debug-moe", "--steps", "3", "--parallel.dp-shard", "2",
           "--parallel.ep", "2", "--parallel.ep-chunks", "2", "--run-dir", str(run_dir), "--output.no-progress",
           "--output.sample-tokens", "0", "--output.no-parity-check", "--validation.every", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "moe/hidden_frac" in r]
    assert len(train) == 3
    for name in ("dispatch_wait_s", "combine_wait_s", "sync_wait_s", "hidden_frac", "imbalance", "dropped_tokens"):
        assert f"moe/{name}" in train[-1] and f"layers.0.feed_forward/{name}" in train[-1]
    assert train[-1]["moe/dropped_tokens"] == 0.0 and train[-1]["moe/imbalance"] >= 1.0
    entry = json.loads((run_dir / "manifest.json").read_text())["parallel"]["expert_dispatch"]
    assert entry["ep_chunks"] == 2 and entry["overlap"] and entry["drop_policy"] == "no-drop"
