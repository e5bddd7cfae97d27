"""The step seam takes the objective as a piece: the RL learner's forward + backward goes through
``ParallelRuntime.loss_and_backward`` (as pretraining's does), with the same gradients as the
policy loss backpropagated by hand; a custom objective plugged into the runtime is the one run,
wrapped with the runtime's stages; layouts the RL objective cannot run on are config errors."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lockstep.cli_rl import resolve_rl_config
from lockstep.config.base import ConfigError
from lockstep.parallel.runtime import ParallelRuntime
from lockstep.rl.learner import EpisodeRecord, Learner
from lockstep.rl.objective import PolicyObjective, pad_rows
from lockstep.rl.policy import load_policy
from lockstep.rl.scoring import score_logprobs
from lockstep.run.objective import LMObjective
from lockstep.run.step import StepLoss


def _config(tmp_path, *flags):
    config, _ = resolve_rl_config(["--recipe", "rl-debug", "--run-dir", str(tmp_path / "run"),
                                   "--workers.generators", "0", *flags])
    return config


def _records(version: int = 0) -> list[EpisodeRecord]:
    """Two groups of four episodes, responses of different lengths (padding exercised)."""
    out = []
    for g in range(2):
        for s in range(4):
            response = [10 + s, 20 + g, 30 + s][: 2 + (s + g) % 2]
            ids = [5, 6, 7] + response
            out.append(EpisodeRecord(group=g, sample=s, task_seed=g, task_id=f"t{g}", prompt_len=3, token_ids=ids,
                                     loss_mask=[0, 0, 0] + [1] * len(response),
                                     logprobs=[0.0] * 3 + [-2.0 - 0.1 * i for i in range(len(response))],
                                     reward=float(s) / 3, policy_version=version, temperature=1.0, num_turns=1,
                                     truncated=None))
    return out


class _Timer:
    def __init__(self):
        self.stages = []

    @contextlib.contextmanager
    def stage(self, name):
        self.stages.append(name)
        yield


def test_learner_backward_goes_through_the_runtime_seam(tmp_path, monkeypatch):
    """Every backward of a learner step runs inside ``runtime.loss_and_backward`` with the learner's
    PolicyObjective, once per micro-batch."""
    config = _config(tmp_path, "--training.micro-batch-size", "4", "--loss.kl-coef", "0.05",
                     "--training.ratio-to", "current")
    learner = Learner(config, load_policy(config).model)
    seam_calls, backwards = [], []
    inside = [False]
    original_seam = learner.runtime.loss_and_backward

    def seam(batch, accumulate=1, timer=None, objective=None):
        seam_calls.append(objective)
        inside[0] = True
        try:
            return original_seam(batch, accumulate, timer, objective=objective)
        finally:
            inside[0] = False

    original_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        backwards.append(inside[0])
        return original_backward(self, *args, **kwargs)

    monkeypatch.setattr(learner.runtime, "loss_and_backward", seam)
    monkeypatch.setattr(torch.Tensor, "backward", backward)
    out = learner.step(1, _records(), trainer_version=0)
    assert len(seam_calls) == 2 and all(o is learner.objective for o in seam_calls)  # 8 episodes, micro-batch 4
    assert isinstance(learner.objective, PolicyObjective)
    assert backwards == [True, True]  # no backward outside the seam
    assert out["grad_norm"] > 0 and out["loss/n_tokens"] == 20 and "loss/kl" in out  # tokens: summed


def test_policy_objective_gradients_equal_the_loss_backpropagated_by_hand(tmp_path):
    """The seam + PolicyObjective gives bitwise the gradients of ``score_logprobs`` + PolicyLoss +
    backward written out (the learner's path before the seam), with the reference's KL term."""
    config = _config(tmp_path, "--loss.kl-coef", "0.05", "--training.ratio-to", "current", "--loss.tis-cap", "2")
    model = load_policy(config).model
    learner = Learner(config, model)
    records = _records()
    width = max(len(r.token_ids) - r.prompt_len for r in records)
    mask = pad_rows([torch.tensor(r.loss_mask[3:], dtype=torch.float32) for r in records], width)
    gen = pad_rows([torch.tensor(r.logprobs[3:]) for r in records], width)
    adv = torch.linspace(-1, 1, len(records))
    keep = torch.ones(len(records), dtype=torch.bool)
    seqs, lens, temps = [r.token_ids for r in records], [3] * len(records), [1.0] * len(records)

    with torch.no_grad():
        ref = pad_rows(score_logprobs(learner.reference, seqs, lens), width)
    loss, metrics = learner.loss(pad_rows(score_logprobs(model, seqs, lens), width), mask, adv, ref_logp=ref,
                                 generator_logp=gen, keep=keep, normaliser=8.0)
    loss.backward()
    by_hand = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    from lockstep.rl.objective import PolicyBatch

    report = learner.runtime.loss_and_backward(PolicyBatch(seqs, lens, temps, mask, gen, adv, keep, 8.0),
                                               objective=learner.objective)
    assert torch.equal(report.loss, loss.detach())
    assert set(report.metrics) == {f"loss/{k}" for k in metrics}
    assert len(report.logprobs) == len(records) and not report.logprobs[0].requires_grad
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, by_hand[n]), n


def test_a_custom_objective_is_the_one_the_runtime_runs():
    """The runtime runs whatever objective it is given, wrapped in its stages, backpropagating its
    loss / accumulate; the default is the LM objective (bitwise the same as passing it)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model.pop_auxiliary = lambda: ({}, {})
    runtime = ParallelRuntime.local("cpu")
    runtime.model = model
    x = torch.randn(5, 4)
    seen = []

    def squares(m, batch):
        seen.append(batch)
        out = m(batch[0]).pow(2).mean()
        return out * 3, StepLoss(out.detach(), metrics={"custom": 1.0})

    timer = _Timer()
    report = runtime.loss_and_backward((x,), accumulate=2, timer=timer, objective=squares)
    assert len(seen) == 1 and torch.equal(seen[0][0], x)
    assert report.metrics == {"custom": 1.0} and timer.stages == ["forward", "backward"]
    grad = model.weight.grad.clone()
    model.zero_grad()
    (model(x).pow(2).mean() * 3 / 2).backward()
    assert torch.equal(grad, model.weight.grad)
    assert torch.equal(runtime.loss((x,), objective=squares).loss, report.loss)  # evaluation: same forward

    # the default objective is next-token cross-entropy on (inputs, targets)
    lm = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11))
    lm.pop_auxiliary = lambda: ({}, {})
    runtime.model = lm
    batch = (torch.randint(0, 11, (2, 7)), torch.randint(0, 11, (2, 7)))
    default = runtime.loss_and_backward(batch)
    grads = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad(set_to_none=True)
    explicit = runtime.loss_and_backward(batch, objective=LMObjective())
    assert torch.equal(default.loss, explicit.loss)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, lm.parameters()))


def test_a_custom_objective_is_refused_on_a_context_parallel_runtime():
    from lockstep.parallel.context import ContextParallel

    runtime = ParallelRuntime.local("cpu")
    runtime.model = torch.nn.Linear(2, 2)
    runtime.context = ContextParallel(None)
    with pytest.raises(ValueError, match="run the LM objective only"):
        runtime.loss_and_backward((torch.zeros(1, 2),), objective=lambda m, b: (m(b[0]).sum(), StepLoss(None)))


def test_rl_refuses_layouts_its_objective_cannot_run_on(tmp_path):
    with pytest.raises(ConfigError, match="parallel.cp: the RL trainer supports dp_replicate, dp_shard, tp, ep and pp "
                                          "layouts, got cp=2: .* LM objective only"):
        _config(tmp_path, "--parallel.cp", "2", "--workers.generators", "1")
