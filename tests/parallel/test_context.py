"""Context parallelism: sharded-sequence attention and training equal one process on the full sequence.

Tolerance 1e-5 (fp32, absolute): CP computes the same softmax(q k^T) v over the same keys, only in
another summation order (key prefixes per query chunk through the kernel, or ring blocks merged by
log-sum-exp), which moves O(1) outputs and gradients by ~1e-7 and a loss of ~8 by a few 1e-7 over 5
steps. A wrong mask (one key too many or too few), a wrong position, or a gradient left on the wrong
rank moves them by >1e-3.
"""

import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lockstep.models.common.attention import GroupedQueryAttention
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.ops.attention import reference_attention, sdpa_attention
from lockstep.parallel.context import (
    ContextParallel,
    ring_attention,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)

TOL = 1e-5
SLOW = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_unshard_and_positions(cp):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    shards = [shard_sequence(x, r, cp, dim=1) for r in range(cp)]
    assert torch.equal(unshard_sequence(shards, dim=1), x)
    positions = [shard_positions(24, r, cp) for r in range(cp)]
    for r in range(cp):
        assert torch.equal(shards[r][0, :, 0] // 3, positions[r])  # row t of x holds 3t..3t+2
    assert sorted(torch.cat(positions).tolist()) == list(range(24))
    if cp == 2:  # chunks of 6: rank 0 holds 0 and 3, rank 1 holds 1 and 2
        assert positions[0].tolist() == [*range(0, 6), *range(18, 24)]
        assert positions[1].tolist() == [*range(6, 18)]


def test_sequence_must_split_into_2cp_chunks():
    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 4"):
        shard_sequence(torch.zeros(1, 10), 0, 2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dv", [16, 8])
def test_ring_block_math_matches_sdpa_in_one_process(causal, dv):
    """The ring kernel's forward/backward (cp = 1: a single block) against PyTorch attention, GQA."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 24, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 24, dv, generator=g, requires_grad=True)
    gout = torch.randn(2, 4, 24, dv, generator=g)
    results = []
    for fn in (lambda: ring_attention(q, k, v, causal=causal, scale=None, group=None, cp_rank=0, cp_size=1),
               lambda: reference_attention(q, k, v, causal=causal)):
        out = fn()
        grads = torch.autograd.grad((out * gout).sum(), (q, k, v))
        results.append((out, *grads))
    for a, b in zip(*results):
        assert (a - b).abs().max() < TOL


def test_install_and_uninstall_wrap_every_attention_layer():
    model = build_model(model_config("llama3", "debug"), seed=0)
    modules = [m for m in model.modules() if isinstance(m, GroupedQueryAttention)]
    cp = ContextParallel()  # not distributed: world 1
    with cp.installed(model):
        assert modules and all(m.attention_wrapper == cp.wrap for m in modules)
        with pytest.raises(RuntimeError, match="already installed"):
            cp.install(model)
        tokens = torch.randint(0, 4096, (1, 16))
        out = model(tokens, positions=cp.positions(16))
    assert all(m.attention_wrapper is None and m.backend_name == "sdpa" for m in modules)
    assert torch.equal(out, model(tokens))


def test_cp_wraps_the_kernel_each_layer_resolves_to(monkeypatch):
    """Installed before or after the batch-invariant switch is set, CP runs around the kernel the
    layer resolves to per call (the invariant one while the switch is on), never a stale one."""
    from lockstep import numerics
    from lockstep.ops import attention

    model = build_model(model_config("llama3", "debug"), seed=0)
    tokens = torch.randint(0, 4096, (1, 16))
    with numerics.batch_invariant():
        invariant = model(tokens)
    cp = ContextParallel()
    seen = []
    inner_of = cp.wrap

    def spy(inner, *args, **kwargs):
        seen.append(inner)
        return inner_of(inner, *args, **kwargs)

    monkeypatch.setattr(cp, "wrap", spy)
    with cp.installed(model):
        plain = model(tokens)
        with numerics.batch_invariant():
            wrapped_invariant = model(tokens)
    n = len(model.layers)
    assert seen == [attention.get_attention("sdpa")] * n + [attention.get_attention("batch_invariant")] * n
    assert torch.equal(wrapped_invariant, invariant)
    assert torch.equal(plain, model(tokens))


# ----------------------------------------------------------------------------- world 2 and 4 (gloo)


def _init(rank, world, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _exit():
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _attention_worker(rank, world, init_file, out_dir):
    _init(rank, world, init_file)
    results = {}
    t = 16 * world
    for method in ("allgather", "ring"):
        cp = ContextParallel(method=method)
        for causal in (True, False):
            for dv in (16, 8):  # 8: MLA-like narrower values
                g = torch.Generator().manual_seed(1)
                q = torch.randn(2, 4, t, 16, generator=g, requires_grad=True)
                k = torch.randn(2, 2, t, 16, generator=g, requires_grad=True)
                v = torch.randn(2, 2, t, dv, generator=g, requires_grad=True)
                gout = torch.randn(2, 4, t, dv, generator=g)
                ref = sdpa_attention(q, k, v, causal=causal)
                ref_grads = torch.autograd.grad((ref * gout).sum(), (q, k, v))
                local = [cp.shard(x.detach(), dim=2).requires_grad_() for x in (q, k, v)]
                out = cp.attention(*local, causal=causal)
                (out * cp.shard(gout, dim=2)).sum().backward()
                expected = [ref, *ref_grads]
                got = [out, *(x.grad for x in local)]
                results[(method, causal, dv)] = [
                    float((a.detach() - cp.shard(b.detach(), dim=2)).abs().max()) for a, b in zip(got, expected)]
                results[(method, causal, dv, "scale")] = float(ref.detach().abs().max())
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    _exit()


def _train(model, steps, batches, loss_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses, first_grads = [], None
    for inputs, targets in batches[:steps]:
        loss_value = loss_fn(model, inputs, targets)
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_value)
    return losses, first_grads


def _model_worker(rank, world, init_file, out_dir):
    _init(rank, world, init_file)
    cfg = model_config("llama3", "debug")
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(5):
        tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))

    def full_loss(model, inputs, targets):
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        return loss.item()

    ref_losses, ref_grads = _train(build_model(cfg, seed=0), 5, batches, full_loss)
    results = {"reference": ref_losses}
    for method in ("allgather", "ring"):
        cp = ContextParallel(method=method)
        model = build_model(cfg, seed=0)
        cp.install(model)

        def cp_loss(model, inputs, targets, cp=cp):
            inputs, targets, positions = cp.shard_batch(inputs, targets)
            local, value = cp.cross_entropy(model(inputs, positions=positions), targets)
            local.backward()
            cp.all_reduce_grads(model.parameters())
            return float(value)

        losses, grads = _train(model, 5, batches, cp_loss)
        results[method] = losses
        results[(method, "grad")] = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
    results["grad_scale"] = max(float(g.abs().max()) for g in ref_grads.values())
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    _exit()


def _spawn(worker, world, tmp_path):
    mp.spawn(worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
@pytest.mark.xdist_group("parallel")
def test_cp_attention_matches_full_attention(tmp_path, world):
    """Output and q/k/v gradients of every rank's slice equal those of full causal (and full)
    attention, GQA 4 q heads / 2 kv heads, both exchanges; world 4 has distinct ring neighbours."""
    for rank, results in enumerate(_spawn(_attention_worker, world, tmp_path)):
        for key, diffs in results.items():
            if key[-1] == "scale":
                assert results[key] > 1.0  # outputs are O(1): 1e-5 absolute is ~1e-5 relative
                continue
            assert max(diffs) < TOL, (rank, key, diffs)


@pytest.mark.slow
@pytest.mark.xdist_group("parallel")
def test_cp_training_matches_one_process(tmp_path):
    """llama3 debug, T = 64 split over cp = 2: 5 AdamW steps give the losses of one process."""
    for rank, results in enumerate(_spawn(_model_worker, 2, tmp_path)):
        ref = results["reference"]
        assert len(ref) == 5 and ref[0] > 8.0
        for method in ("allgather", "ring"):
            diffs = [abs(a - b) for a, b in zip(results[method], ref)]
            assert max(diffs) < TOL, (rank, method, results[method], ref)
            # step-0 gradients, summed over cp ranks, equal the full-sequence ones
            assert results[(method, "grad")] < TOL * results["grad_scale"], (rank, method, results)
