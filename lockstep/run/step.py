"""A step's scalars without a host synchronisation per micro-batch.

:class:`StepLoss` is what one micro-batch's forward (and backward) reports: the main loss and the
auxiliary losses as detached tensors, and the modules' metrics (MoE expert load, ...).
:class:`StepScalars` sums them over a step's micro-batches on this rank, as tensors, then
``reduce()`` averages every scalar over the ranks holding it with ONE all_reduce of a stacked
tensor and turns them into Python floats once (the step's only host synchronisation).

Sums run in float64 in micro-batch order, ``value / divide_by`` each, exactly as the trainer's
Python-float accumulation did: a one-process run reports bitwise the same numbers as before.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from lockstep.checkpoint.train_state import clean_fqn


@dataclasses.dataclass
class StepLoss:
    """One micro-batch's report. ``loss``: the main loss (detached; None on ranks that do not compute
    it, e.g. pipeline stages without the head); ``aux_losses``: the auxiliary losses that were added
    to it (detached); ``metrics``: module metrics (tensors or floats)."""

    loss: torch.Tensor | None
    aux_losses: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    metrics: dict[str, torch.Tensor | float] = dataclasses.field(default_factory=dict)

    def scalars(self, loss_name: str = "loss") -> dict[str, torch.Tensor | float]:
        """Every reported scalar by its metrics name (module paths without wrapper prefixes)."""
        out: dict[str, torch.Tensor | float] = {} if self.loss is None else {loss_name: self.loss}
        out.update({f"aux_loss/{clean_fqn(k)}": v for k, v in self.aux_losses.items()})
        out.update({clean_fqn(k): v for k, v in self.metrics.items()})
        return out


class StepScalars:
    """Per-rank running sums of named scalars; ``reduce`` once per step (collective over ``group``).

    ``gather_names``: the ranks may hold different names (pipeline stages own different layers), so
    the first ``reduce`` agrees on their union with one ``all_gather_object``; later steps reuse it.
    """

    def __init__(self, device: torch.device | str = "cpu", *, group=None, distributed: bool = False,
                 gather_names: bool = False) -> None:
        self.device = torch.device(device)
        self.group, self.distributed, self.gather_names = group, distributed, gather_names
        self._sums: dict[str, torch.Tensor] = {}
        self._names: list[str] | None = None

    def add(self, values: dict[str, torch.Tensor | float], divide_by: float = 1,
            multiply_by: float | None = None) -> None:
        """Add ``value * multiply_by / divide_by`` to each name's sum (detached, float64, on the device)."""
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()
                if hasattr(value, "full_tensor"):  # a DTensor loss (loss_parallel): its replicated value
                    value = value.full_tensor()
                v = value.to(device=self.device, dtype=torch.float64).reshape(())
            else:  # a fill, not a host-to-device copy (which would wait for the device)
                v = torch.full((), float(value), dtype=torch.float64, device=self.device)
            if multiply_by is not None:
                v = v * multiply_by
            if divide_by != 1:
                v = v / divide_by
            self._sums[name] = self._sums[name] + v if name in self._sums else v

    def add_loss(self, step_loss: StepLoss, divide_by: float = 1, loss_name: str = "loss") -> None:
        self.add(step_loss.scalars(loss_name), divide_by)

    def _agreed_names(self) -> list[str]:
        mine = sorted(self._sums)
        if not (self.distributed and self.gather_names):
            return mine
        if self._names is None or not set(mine) <= set(self._names):
            world = dist.get_world_size(self.group)
            everyone: list = [None] * world
            dist.all_gather_object(everyone, mine, group=self.group)
            self._names = sorted({n for names in everyone for n in names})
        return self._names

    def reduce(self, mean: bool = True) -> dict[str, float]:
        """Each scalar over the ranks as floats -- their mean over the ranks that hold it, or
        (``mean=False``) their sum -- in one all_reduce; resets the sums."""
        names = self._agreed_names()
        sums, self._sums = self._sums, {}
        if not names:
            return {}
        if not self.distributed:
            return {n: float(v) for n, v in zip(names, torch.stack([sums[n] for n in names]).tolist())}
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        values = torch.stack([sums.get(n, zero) for n in names])
        counts = torch.tensor([1.0 if n in sums else 0.0 for n in names], dtype=torch.float64, device=self.device)
        both = torch.cat([values, counts])
        dist.all_reduce(both, group=self.group)
        total, count = both[:len(names)], both[len(names):]
        out = (total / count.clamp(min=1)) if mean else total
        return dict(zip(names, out.tolist()))
