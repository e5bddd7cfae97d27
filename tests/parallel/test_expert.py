"""Expert parallelism over world 2 (gloo) equals one process holding every expert.

qwen3_moe debug (8 experts, top-2; 4 per rank), same seed on both ranks, a batch of 4 sequences
split 2 + 2. Tolerance 1e-5 (fp32, absolute): EP runs the same per-expert matmuls on the same rows,
only batched with other rows, so outputs move by ~1e-7 and a loss of ~8 by ~1e-7 over 5 steps; a
token sent to the wrong expert, a result returned to the wrong row, or an expert gradient missing
a rank's tokens (or scaled by the wrong factor) moves them by >1e-3.

One spawn runs every check (``computed_once``: one per test run); the tests read its results.
"""

import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lockstep.config.base import ConfigError
from lockstep.models.common.moe import GroupedExperts
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.checkpointing import apply_activation_checkpointing
from lockstep.parallel.grad import clip_grad_norm
from lockstep.parallel.expert import (
    ExpertParallelExperts,
    apply_expert_parallel,
    clip_grad_norm_expert_parallel,
    expert_parameters,
    expert_state_dict_full,
    gather_full_experts,
    load_expert_state_dict_full,
    sync_expert_parallel_grads,
)

TOL = 1e-5
WORLD = 2
STEPS = 5
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]


def _max_diff(a, b):
    return float((a - b).detach().abs().max())


def _batches(vocab):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (4, 33), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _train(model, batches, step_loss):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses, first_grads = [], None
    for inputs, targets in batches:
        losses.append(step_loss(model, inputs, targets))
        model.pop_auxiliary()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, first_grads


def _ce(model, inputs, targets):
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def _grouped_experts_check(rank, results):
    """Raw ExpertParallelExperts vs GroupedExperts with uneven counts; rank 1's experts get no token."""
    torch.manual_seed(0)
    full = GroupedExperts(8, 16, 8, init_std=0.5)
    ep = ExpertParallelExperts(full)
    counts = torch.tensor([[2, 0, 1, 3, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]][rank])
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(int(counts.sum()), 16, generator=g)
    gout = torch.randn(x.shape, generator=g)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ref, out = full(xs[0], counts), ep(xs[1], counts)
    (ref * gout).sum().backward()
    (out * gout).sum().backward()
    diffs = [_max_diff(out, ref), _max_diff(xs[1].grad, xs[0].grad)]
    for name in ("w1", "w2", "w3"):  # an expert's gradient sums both ranks' tokens
        total = getattr(full, name).grad.clone()
        dist.all_reduce(total)
        diffs.append(_max_diff(getattr(ep, name).grad, total[4 * rank:4 * rank + 4]))
    results["grouped"] = diffs
    results["grouped_scale"] = float(ref.detach().abs().max())


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    cfg = model_config("qwen3_moe", "debug")
    batches = _batches(cfg.vocab_size)
    mine = slice(2 * rank, 2 * rank + 2)

    _grouped_experts_check(rank, results)

    # errors name parallel.ep
    bad = model_config("qwen3_moe", "debug")
    bad.feed_forward.n_routed_experts = 3
    for c in (bad, model_config("llama3", "debug")):
        try:
            apply_expert_parallel(build_model(c, seed=0))
            results.setdefault("errors", []).append(None)
        except ConfigError as e:
            results.setdefault("errors", []).append(str(e))

    # (1) forward: logits of this rank's sequences equal the one-process logits
    ref_model = build_model(cfg, seed=0)
    ref_state = {k: v.clone() for k, v in ref_model.state_dict().items()}
    with torch.no_grad():
        ref_logits = ref_model(batches[0][0])
    ep_model = apply_expert_parallel(build_model(cfg, seed=0))
    with torch.no_grad():
        logits = ep_model(batches[0][0][mine])
    ep_model.pop_auxiliary()
    results["logits"] = _max_diff(logits, ref_logits[mine])
    results["logits_scale"] = float(ref_logits.abs().max())
    results["n_local_experts"] = [m.n_experts for m in ep_model.modules() if isinstance(m, ExpertParallelExperts)]

    # checkpoint helpers and meta init: the full experts round-trip, and meta -> EP -> init is the same model
    full = expert_state_dict_full(ep_model)
    results["gather"] = sorted(full) == sorted(ref_state) and all(torch.equal(full[k], ref_state[k]) for k in full)
    # under activation checkpointing the gathered experts keep the single-process names (no wrapper prefix)
    wrapped = apply_expert_parallel(build_model(cfg, seed=0))
    apply_activation_checkpointing(wrapped, "full")
    results["gather_ac_keys"] = sorted(gather_full_experts(wrapped))
    with torch.device("meta"):
        meta = cfg.build()
    apply_expert_parallel(meta)
    meta.to_empty(device="cpu")
    meta.tie_weights()
    meta.init_weights(0)
    results["meta_init"] = all(torch.equal(v, ep_model.state_dict()[k]) for k, v in meta.state_dict().items())
    load_expert_state_dict_full(meta, {k: torch.zeros_like(v) for k, v in ref_state.items()})
    load_expert_state_dict_full(meta, ref_state)
    results["load"] = all(torch.equal(v, ep_model.state_dict()[k]) for k, v in meta.state_dict().items())

    # (2) training: one process on all 4 sequences vs EP, each rank on its 2
    norms = {"ref": [], "ep": []}

    def full_step(model, inputs, targets):
        loss = _ce(model, inputs, targets)
        loss.backward()
        norms["ref"].append(float(clip_grad_norm(model.parameters(), float("inf"))))
        return float(loss)

    def ep_step(model, inputs, targets):
        loss = _ce(model, inputs[mine], targets[mine])
        loss.backward()
        sync_expert_parallel_grads(model)
        norms["ep"].append(float(clip_grad_norm_expert_parallel(model, float("inf"))))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return float(mean) / world

    ref_losses, ref_grads = _train(build_model(cfg, seed=0), batches, full_step)
    ep_losses, ep_grads = _train(apply_expert_parallel(build_model(cfg, seed=0)), batches, ep_step)
    results["ref_losses"], results["ep_losses"] = ref_losses, ep_losses
    results["norms"] = norms
    expert_names = {n for n, p in ep_model.named_parameters() if any(p is q for q in expert_parameters(ep_model))}
    grad_diffs = {}
    for name, g in ep_grads.items():
        ref = ref_grads[name][4 * rank:4 * rank + 4] if name in expert_names else ref_grads[name]
        grad_diffs[name] = _max_diff(g, ref)
    results["grads"] = grad_diffs
    results["n_expert_params"] = len(expert_names)
    results["grad_scale"] = max(float(g.abs().max()) for g in ref_grads.values())

    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def results(computed_once):
    tmp = computed_once("expert-parallel spawn", lambda d: mp.spawn(
        _worker, args=(WORLD, str(d / "init"), str(d)), nprocs=WORLD, join=True))
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


def test_grouped_experts_dispatch_matches_one_process(results):
    """Uneven counts (one rank's experts receive no token): outputs, input and expert grads."""
    for rank, res in enumerate(results):
        assert res["grouped_scale"] > 0.1
        assert max(res["grouped"]) < TOL * max(1.0, res["grouped_scale"]), (rank, res["grouped"])


def test_errors_name_parallel_ep(results):
    for res in results:
        indivisible, dense = res["errors"]
        assert indivisible is not None and "parallel.ep" in indivisible and "n_routed_experts=3" in indivisible
        assert dense is not None and "parallel.ep" in dense


def test_forward_logits_match_one_process(results):
    for rank, res in enumerate(results):
        assert res["n_local_experts"] == [4, 4]
        assert res["logits_scale"] > 0.1
        assert res["logits"] < TOL, (rank, res["logits"])


def test_state_dict_gather_load_and_meta_init(results):
    for res in results:
        assert res["gather"] and res["load"] and res["meta_init"]


def test_gathered_expert_names_drop_activation_checkpoint_wrappers(results):
    for res in results:
        keys = res["gather_ac_keys"]
        assert keys and all("_checkpoint_wrapped_module" not in k for k in keys), keys
        assert "layers.0.feed_forward.experts.w1" in keys


def test_training_matches_one_process(results):
    """5 AdamW steps: the mean of the ranks' losses equals one process's loss on all 4 sequences;
    step-0 gradients (replicated averaged, experts divided by ep) and every step's gradient norm
    equal the one-process ones."""
    for rank, res in enumerate(results):
        ref, got = res["ref_losses"], res["ep_losses"]
        assert len(ref) == STEPS and ref[0] > 8.0
        assert max(abs(a - b) for a, b in zip(got, ref)) < TOL, (rank, got, ref)
        assert res["n_expert_params"] == 6  # 2 MoE layers x w1/w2/w3
        # the clip norm sums every rank's expert gradients: the one-process norm on every rank
        assert max(abs(a - b) for a, b in zip(res["norms"]["ep"], res["norms"]["ref"])) < TOL, res["norms"]
        worst = max(res["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < TOL * max(1.0, res["grad_scale"]), (rank, worst)
