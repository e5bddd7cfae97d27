"""The capture itself: what is an input, what each node says of where it came from, clear errors,
module state threaded through replays, refused layouts, and RL's learner in graph mode."""

import contextlib
import copy
import re

import pytest
import torch
from torch import nn

from lockstep.config.base import ConfigError
from lockstep.graph.capture import GraphCaptureError, capture_step
from lockstep.graph.step import GraphStep
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.runtime import ParallelRuntime
from lockstep.run.objective import LMObjective
from lockstep.run.step import StepLoss

pytestmark = pytest.mark.xdist_group("graph_capture")


def _batch(cfg, B=2, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (B, T), generator=g),
            torch.randint(0, cfg.vocab_size, (B, T), generator=g))


@pytest.fixture(scope="module")
def llama():
    cfg = model_config("llama3", "debug")
    model = build_model(cfg, seed=0)
    captured, _ = capture_step(model, LMObjective(), _batch(cfg))
    return cfg, model, captured


def test_parameters_buffers_and_batch_are_inputs_not_constants(llama):
    cfg, model, captured = llama
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    n_params = len(list(model.parameters()))
    assert len(placeholders) == n_params + len(list(model.buffers())) + 2
    sizes = {tuple(p.shape) for p in model.parameters()}
    constants = [getattr(captured.gm, n.target) for n in captured.gm.graph.nodes if n.op == "get_attr"]
    assert not [c for c in constants if isinstance(c, torch.Tensor) and tuple(c.shape) in sizes]


def test_every_node_carries_its_module_path_and_phase(llama):
    _, _, captured = llama
    nodes = list(captured.gm.graph.nodes)
    assert all(n.meta["phase"] in ("forward", "backward") and isinstance(n.meta["module_path"], str) for n in nodes)
    backward_attention = [n for n in nodes if n.meta["phase"] == "backward"
                          and n.meta["module_path"].startswith("layers.0.attention")]
    forward_attention = [n for n in nodes if n.meta["phase"] == "forward"
                         and n.meta["module_path"].startswith("layers.0.attention")]
    assert backward_attention and forward_attention
    assert {n.meta["module_path"] for n in backward_attention} >= {"layers.0.attention.wq", "layers.0.attention.wo"}
    # the loss (cross-entropy outside any module) and its gradient carry ""
    loss_nodes = [n for n in nodes if n.op == "call_function" and "nll_loss" in str(n.target)]
    assert loss_nodes and all(n.meta["module_path"] == "" for n in loss_nodes)
    assert {n.meta["phase"] for n in loss_nodes} == {"forward", "backward"}


class _Reads(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)[: int(x.sum() > 0) + 1]  # a host read of a tensor value


class _Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Reads()

    def forward(self, x):
        return self.inner(x)


def _sum_objective(model, batch):
    loss = model(batch[0]).sum()
    return loss, StepLoss(loss.detach())


def test_a_data_dependent_read_is_a_clear_error_naming_the_module():
    with pytest.raises(GraphCaptureError, match=r"module 'inner'.*training.mode=eager"):
        capture_step(_Wrapper(), _sum_objective, (torch.randn(3, 4),))


def test_a_missing_torch_api_names_the_torch_version(monkeypatch):
    monkeypatch.delattr(torch.autograd, "_get_sequence_nr")
    with pytest.raises(GraphCaptureError, match=rf"torch {re.escape(torch.__version__)}.*training.mode=eager"):
        capture_step(nn.Linear(2, 2), _sum_objective, (torch.randn(3, 2),))


class _Pooling(nn.Module):
    """Keeps a running sum of its outputs in a plain attribute (like MoE's pending expert counts) and a
    statistic of the last forward (like MoE's load stats)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pending: torch.Tensor | None = None
        self.last: torch.Tensor | None = None

    def forward(self, x):
        y = self.lin(x)
        s = y.detach().sum(0)
        self.pending = s if self.pending is None else self.pending + s
        self.last = y.detach().max()
        return y * (1 + 0 * self.pending.sum())


def test_module_state_is_threaded_through_replays():
    torch.manual_seed(0)
    eager_model = _Pooling()
    graph_model = copy.deepcopy(eager_model)
    step = GraphStep()
    for i in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        loss, _ = _sum_objective(eager_model, (x,))
        loss.backward()
        step.step(graph_model, _sum_objective, (x,), 1, contextlib.nullcontext)
        assert torch.equal(eager_model.pending, graph_model.pending)
        assert torch.equal(eager_model.last, graph_model.last)
        assert torch.equal(eager_model.lin.weight.grad, graph_model.lin.weight.grad)  # accumulated in place
    assert step.captures == 2  # without, then with a pending sum: two module-state structures


def test_check_steps_runs_eager_beside_the_graph_and_finds_no_divergence():
    from lockstep.graph.config import GraphConfig

    cfg = model_config("qwen3_moe", "debug")
    model = build_model(cfg, seed=0)
    step, objective = GraphStep(GraphConfig(check_steps=2)), LMObjective()
    for seed in range(3):
        step.step(model, objective, _batch(cfg, seed=seed), 1, contextlib.nullcontext)
    assert step.checks == [None, None]  # two micro-batches checked, every node bitwise equal
    assert step.captures == 1


def test_graph_mode_refuses_layouts_it_does_not_support():
    dims = ParallelConfig(dp_shard=1, tp=2).resolve(2)
    runtime = ParallelRuntime(0, 2, torch.device("cpu"), dims, None, 0)
    with pytest.raises(ConfigError, match=r"training.mode.*parallel.tp=2"):
        runtime.parallelize(nn.Linear(2, 2), ParallelConfig(dp_shard=1, tp=2), mode="graph")


def test_graph_mode_refuses_selective_checkpointing_and_batch_invariant_kernels(monkeypatch):
    from lockstep import numerics

    runtime = ParallelRuntime.local("cpu")
    with pytest.raises(ConfigError, match=r"activation_checkpoint.mode: 'selective'.*training.mode=graph"):
        runtime.parallelize(nn.Linear(2, 2), ParallelConfig(dp_shard=1), "selective", mode="graph")
    monkeypatch.setattr(numerics, "is_batch_invariant", lambda: True)
    with pytest.raises(ConfigError, match=r"numerics.batch_invariant.*training.mode=eager"):
        ParallelRuntime.local("cpu").parallelize(nn.Linear(2, 2), ParallelConfig(dp_shard=1), mode="graph")


def test_full_activation_checkpointing_replays_bitwise():
    """The recompute runs inside the captured backward with the graph's parameters (no constants)."""
    cfg = model_config("llama3", "debug")
    results = []
    for mode in ("eager", "graph"):
        runtime = ParallelRuntime.local("cpu")
        model = runtime.parallelize(build_model(cfg, seed=0), ParallelConfig(dp_shard=1), "full", mode=mode)
        losses = [runtime.loss_and_backward(_batch(cfg, seed=s), 2).loss for s in range(2)]
        results.append((losses, {n: p.grad for n, p in model.named_parameters()}))
    (el, eg), (gl, gg) = results
    assert all(torch.equal(a, b) for a, b in zip(el, gl))
    assert all(torch.equal(eg[k], gg[k]) for k in eg)


def test_rl_learner_graph_mode_equals_eager(tmp_path):
    """One RL learner step (GRPO, two micro-batches, a KL reference) in graph mode: the same loss,
    metrics, trainer log-probabilities and updated weights as eager."""
    from lockstep.cli_rl import resolve_rl_config
    from lockstep.rl.learner import EpisodeRecord, Learner
    from lockstep.rl.policy import load_policy

    def records():
        out = []
        for g in range(2):
            for s in range(4):
                response = [10 + s, 20 + g, 30 + s][: 2 + (s + g) % 2]
                out.append(EpisodeRecord(group=g, sample=s, task_seed=g, task_id=f"t{g}", prompt_len=3,
                                         token_ids=[5, 6, 7] + response, loss_mask=[0, 0, 0] + [1] * len(response),
                                         logprobs=[0.0] * 3 + [-2.0 - 0.1 * i for i in range(len(response))],
                                         reward=float(s) / 3, policy_version=0, temperature=1.0, num_turns=1,
                                         truncated=None))
        return out

    results = {}
    for mode in ("eager", "graph"):
        config, _ = resolve_rl_config(["--recipe", "rl-debug", "--run-dir", str(tmp_path / mode),
                                       "--workers.generators", "0", "--training.micro-batch-size", "4",
                                       "--loss.kl-coef", "0.05", "--training.mode", mode])
        learner = Learner(config, load_policy(config).model)
        metrics = learner.step(0, records(), trainer_version=0)
        results[mode] = (metrics, {k: v.clone() for k, v in learner.model.state_dict().items()}, learner)
    (em, ew, _), (gm, gw, learner) = results["eager"], results["graph"]
    assert learner.runtime.graph is not None and gm.pop("graph/captures") >= 1
    timing = {"trainer/tokens_per_s", "time/training"}
    assert {k: v for k, v in em.items() if k not in timing} == {k: v for k, v in gm.items() if k not in timing}
    assert all(torch.equal(ew[k], gw[k]) for k in ew)
