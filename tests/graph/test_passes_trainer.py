"""The passes through the GraphTrainer's step seam: eager = graph, bitwise, over 3 AdamW steps with the
memory budget on, and the debugging aids (graph.check_steps, graph.dump_dir) as the trainer drives them."""

from __future__ import annotations

import json

import pytest
import torch

from lockstep.graph.config import GraphConfig
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.runtime import ParallelRuntime
from tests.graph.test_graph_bitwise import _assert_same

pytestmark = pytest.mark.xdist_group("graph_bitwise")


def _run(family, dtype, mode, graph_config=None, accumulate=1, steps=3):
    cfg = model_config(family, "debug")
    model = build_model(cfg, seed=0)
    rt = ParallelRuntime.local("cpu", dtype=dtype)
    model = rt.parallelize(model, ParallelConfig(dp_shard=1), mode=mode, graph_config=graph_config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    reports, grads = [], []
    for _ in range(steps):
        for _ in range(accumulate):
            batch = tuple(torch.randint(0, cfg.vocab_size, (2, 16), generator=gen) for _ in range(2))
            r = rt.loss_and_backward(batch, accumulate)
            reports.append((r.loss, r.aux_losses, r.metrics))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        rt.apply_step(opt)
    return reports, grads, {k: v.clone() for k, v in model.state_dict().items()}, rt


@pytest.mark.parametrize("family,dtype,accumulate", [("llama3", torch.bfloat16, 2), ("qwen3_moe", torch.float32, 1)])
def test_memory_budget_is_bitwise_eager(family, dtype, accumulate):
    config = GraphConfig(memory_budget=0.5)
    graph = _run(family, dtype, "graph", config, accumulate)
    _assert_same(_run(family, dtype, "eager", accumulate=accumulate), graph)
    memory = graph[3].graph.records["memory"]
    assert memory["budget_met"] and 0 < memory["saved_bytes_after"] <= 0.5 * memory["saved_bytes_before"]
    assert graph[3].graph.records["recompute"]["nodes_recomputed"] > 0


def test_check_steps_and_dump_through_the_trainer(tmp_path):
    config = GraphConfig(check_steps=2, dump_dir=str(tmp_path))
    rt = _run("llama3", torch.bfloat16, "graph", config, steps=3)[3]
    assert rt.graph.checks == [None, None]  # two micro-batches checked, every node equal to eager
    summary = json.loads((tmp_path / "02_memory_summary.json").read_text())
    assert summary["records"]["saved_bytes_after"] < summary["records"]["saved_bytes_before"]
    assert summary["blocks"]["layers.1"]["nodes"]["backward"] > 0  # backward nodes carry their block
