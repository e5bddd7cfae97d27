"""The step seam's reduction: scalars stay tensors over micro-batches, one all_reduce per step, the
same numbers as the Python-float accumulation it replaced, and no host sync that grows with grad_accum."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from lockstep.recipes import get_recipe
from lockstep.run import StepLoss, StepScalars
from lockstep.train.trainer import Trainer

pytestmark = pytest.mark.xdist_group("trainer")


def test_sums_match_python_float_accumulation_bitwise():
    values = [torch.tensor(v, dtype=torch.float32) for v in (2.718281, 3.14159, 1.41421)]
    scalars = StepScalars()
    expected = 0.0
    for v in values:
        scalars.add_loss(StepLoss(v, {"layers.0._checkpoint_wrapped_module.ffn/aux": v * 2}, {"m": float(v)}),
                         divide_by=3)
        expected += float(v) / 3
    out = scalars.reduce()
    assert out["loss"] == expected  # bitwise: float64, same order, same divisions
    assert set(out) == {"loss", "aux_loss/layers.0.ffn/aux", "m"}  # wrapper prefixes stripped
    assert scalars.reduce() == {}  # reduce resets


def _trainer(tmp_path, grad_accum, recipe="debug"):
    cfg = get_recipe(recipe).config()
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / f"{recipe}-ga{grad_accum}"), steps=2)
    cfg.training = dataclasses.replace(cfg.training, grad_accum=grad_accum, batch_size=2)
    cfg.output = dataclasses.replace(cfg.output, progress=False)
    return Trainer(cfg)


class _Counter:
    def __init__(self):
        self.n = 0


@pytest.mark.parametrize("recipe", ["debug", "debug-moe"])  # MoE: its load metrics stay tensors too
def test_one_reduce_per_step_and_host_syncs_do_not_grow_with_grad_accum(tmp_path, monkeypatch, recipe):
    reduces = _Counter()

    def all_reduce(tensor, op=None, group=None, async_op=False):  # world of one: the sum is the tensor
        reduces.n += 1

    syncs = _Counter()
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _original=original, **k):
            syncs.n += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    counts = {}
    for grad_accum in (1, 4):
        trainer = _trainer(tmp_path, grad_accum, recipe)
        # the reduction as in a distributed run (the collective spied on), everything else one process
        trainer.runtime.scalars = lambda t=trainer: StepScalars(t.runtime.device, distributed=True)
        batches = iter(trainer.data.train)
        reduces.n = syncs.n = 0
        out = trainer.train_step(1, batches)
        counts[grad_accum] = (reduces.n, syncs.n)
        assert out["loss"] > 0 and out["grad_norm"] > 0
        if recipe == "debug-moe":  # the metrics reach the record, as numbers
            assert isinstance(out["layers.1.feed_forward/load_max"], float) and out["layers.1.feed_forward/load_max"] > 0
    assert counts[1][0] == counts[4][0] == 1  # one all_reduce per step, not one per micro-batch
    assert counts[4][1] == counts[1][1], counts  # host syncs per step, not per micro-batch


def test_context_parallel_branch_reports_aux_losses_and_moe_metrics():
    """The cp branch of the seam (shard_batch + cp cross-entropy; a one-rank ContextParallel here)
    reports what the plain branch does: the same loss, the auxiliary losses it trained on, the MoE
    load metrics (before this seam, the cp branch dropped both)."""
    from lockstep.cli import resolve_config
    from lockstep.models.common.transformer import build_model
    from lockstep.parallel.context import ContextParallel
    from lockstep.parallel.dims import ParallelConfig
    from lockstep.parallel.runtime import ParallelRuntime

    cfg, _ = resolve_config(["--recipe", "debug-moe", "--override", "layers.*.feed_forward=moe,seq_aux_loss_coef=0.01"])
    batch = (torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32)))
    reports = []
    for cp in (False, True):
        runtime = ParallelRuntime.create(ParallelConfig(dp_shard=1), device="cpu")
        runtime.parallelize(build_model(cfg.model, seed=0), ParallelConfig(dp_shard=1))
        if cp:
            runtime.context = ContextParallel(None)
            runtime.context.install(runtime.model)
        reports.append(runtime.loss_and_backward(batch, accumulate=2))
    plain, context = reports
    assert torch.equal(plain.loss, context.loss)
    assert set(context.aux_losses) == set(plain.aux_losses) == {f"layers.{i}.feed_forward/seq_aux_loss" for i in (0, 1)}
    assert all(torch.equal(plain.aux_losses[k], context.aux_losses[k]) for k in plain.aux_losses)
    assert {"layers.0.feed_forward/load_cv", "layers.1.feed_forward/load_max"} <= set(context.metrics)
    scalars = StepScalars()
    scalars.add_loss(context, divide_by=2)
    assert "aux_loss/layers.1.feed_forward/seq_aux_loss" in scalars.reduce()
