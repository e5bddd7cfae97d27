"""GraphTrainer = eager, bitwise: every loss, every gradient and the weights after 5 AdamW steps.

Each family runs through the runtime's step seam (``ParallelRuntime.loss_and_backward``) in eager and
graph mode with default passes on: fp32 without gradient accumulation, bf16 autocast with
``accumulate=2`` (so each family covers both). One Trainer run compares the whole loop; a changed
sequence length re-captures (counted); MoE aux-loss-free bias updates (module state threaded through
the graph) give the same selection bias and weights.
"""

import dataclasses

import pytest
import torch

from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.runtime import ParallelRuntime

pytestmark = pytest.mark.xdist_group("graph_bitwise")

FAMILIES = ["llama3", "qwen3", "qwen3_moe", "deepseek_v3", "qwen3_next", "qwen3_5", "gpt_oss"]


def _run(cfg, dtype, mode, accumulate, steps=5, B=2, lengths=(16,)):
    """(per micro-batch reports, per step grads, final state, runtime) of ``steps`` AdamW steps."""
    model = build_model(cfg, seed=0)
    rt = ParallelRuntime.local("cpu", dtype=dtype)
    model = rt.parallelize(model, ParallelConfig(dp_shard=1), mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    reports, grads = [], []
    for step in range(steps):
        T = lengths[step % len(lengths)]
        for _ in range(accumulate):
            batch = (torch.randint(0, cfg.vocab_size, (B, T), generator=gen),
                     torch.randint(0, cfg.vocab_size, (B, T), generator=gen))
            r = rt.loss_and_backward(batch, accumulate)
            reports.append((r.loss, r.aux_losses, r.metrics))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        rt.apply_step(opt)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return reports, grads, state, rt


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _assert_same(eager, graph):
    assert _equal(eager[0], graph[0]), "a micro-batch's loss / aux losses / metrics differ"
    for step, (ge, gg) in enumerate(zip(eager[1], graph[1])):
        assert ge.keys() == gg.keys(), f"step {step}: different parameters got gradients"
        bad = [n for n in ge if not torch.equal(ge[n], gg[n])]
        assert not bad, f"step {step}: gradients differ: {bad[:5]}"
    bad = [k for k in eager[2] if not torch.equal(eager[2][k], graph[2][k])]
    assert not bad, f"weights/buffers differ after the steps: {bad[:5]}"


@pytest.mark.parametrize("dtype,accumulate", [(torch.float32, 1), (torch.bfloat16, 2)], ids=["fp32", "bf16-acc2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_graph_step_is_bitwise_eager(family, dtype, accumulate):
    cfg = model_config(family, "debug")
    eager = _run(cfg, dtype, "eager", accumulate)
    graph = _run(cfg, dtype, "graph", accumulate)
    _assert_same(eager, graph)
    assert graph[3].graph.captures == 1  # one shape, one capture, replayed for every micro-batch


def test_changed_shape_recaptures_and_stays_bitwise():
    cfg = model_config("llama3", "debug")
    eager = _run(cfg, torch.float32, "eager", 1, steps=3, lengths=(16, 32))
    graph = _run(cfg, torch.float32, "graph", 1, steps=3, lengths=(16, 32))
    _assert_same(eager, graph)
    assert graph[3].graph.captures == 2  # T=16, T=32, then T=16 again from the cache


def test_moe_bias_updates_through_module_state():
    """Aux-loss-free balancing pools each micro-batch's expert counts in ``MoE.pending_counts`` (module
    state): a graph input/output of the captured step, applied after each optimizer step."""
    cfg = model_config("qwen3_moe", "debug")
    cfg = dataclasses.replace(cfg, feed_forward=dataclasses.replace(cfg.feed_forward, bias_update_speed=0.01))
    eager = _run(cfg, torch.float32, "eager", 2, steps=4)
    graph = _run(cfg, torch.float32, "graph", 2, steps=4)
    _assert_same(eager, graph)
    biases = [k for k in graph[2] if k.endswith("e_score_correction_bias")]
    assert biases and any(graph[2][k].abs().max() > 0 for k in biases)  # the bias did move
    # first micro-batch (no pending counts) and later ones (pending counts as an input): two graphs
    assert graph[3].graph.captures == 2


def test_trainer_graph_mode_matches_eager(tmp_path):
    from lockstep.recipes import get_recipe
    from lockstep.train.trainer import Trainer

    def config(name, mode):
        cfg = get_recipe("debug").config()
        cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / name), steps=3)
        cfg.training = dataclasses.replace(cfg.training, mode=mode, grad_accum=2)
        cfg.output = dataclasses.replace(cfg.output, progress=False)
        return cfg

    eager = Trainer(config("eager", "eager"))
    eager_result = eager.fit()
    graph = Trainer(config("graph", "graph"))
    graph_result = graph.fit()
    assert graph_result.losses == eager_result.losses
    ge, gg = eager.model.state_dict(), graph.model.state_dict()
    assert all(torch.equal(ge[k], gg[k]) for k in ge)
    import json

    manifest = json.loads((graph_result.run_dir / "manifest.json").read_text())
    assert manifest["graph"]["training_mode"] == "graph" and manifest["graph"]["changes_numerics"] is False
    assert "cleanup" in manifest["graph"]["passes"]
    metrics = [json.loads(line) for line in (graph_result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["graph/captures"] for m in metrics if "graph/captures" in m] == [1, 1, 1]
