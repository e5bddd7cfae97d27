"""FlexShard state outside the step: whole parameters for export (``ParallelRuntime.full_state_dict``)."""

from __future__ import annotations

import torch
from torch import nn

from lockstep.checkpoint.train_state import clean_fqn


def full_state_dict(model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """Whole parameters and buffers on the CPU under clean FQNs (a tied head once per name, as
    ``state_dict``); a collective over every flex group. ``keep``: this rank returns them (else {})."""
    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if hasattr(t, "_flex"):
            if id(t) not in gathered:
                gathered[id(t)] = t._flex.gather_full(t).cpu()
            value = gathered[id(t)]
        else:
            value = t.detach().cpu()
        if keep:
            out[clean_fqn(name)] = value
    return out
