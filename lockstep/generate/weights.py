"""Decode weights in another dtype: a copy of the model the engine runs, kept in step with the source.

``EngineConfig.weights_dtype="bfloat16"`` on an fp32 model makes the engine run a *shadow*: the same
module tree (``copy.deepcopy``: the same classes and code, no second model definition) whose floating
parameters are bf16 copies of the source's. Buffers (RoPE tables) are copied unchanged, tied weights
stay tied. On this CPU a bf16 GEMM at decode batch sizes reads half the bytes of fp32 and runs 2-4x
faster, which is what bounds a batched decode step.

The source stays the model of record (an RL trainer keeps updating its fp32 parameters). Before each
step the engine calls :meth:`ShadowWeights.sync`, which compares every source parameter's version
counter (bumped by any in-place write: optimizer steps, ``copy_``, ``load_state_dict``) with the one
it last copied and re-casts only the changed ones; that check costs microseconds. A parameter
*replaced* by a new object is not seen by the version check: :meth:`ShadowWeights.resync` (also
``Engine.sync_weights()``) re-reads every parameter by name.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class ShadowWeights:
    """A ``dtype`` copy of ``source`` (see the module docstring); ``.model`` is what the engine runs."""

    def __init__(self, source: nn.Module, dtype: torch.dtype) -> None:
        self.source, self.dtype = source, dtype
        with torch.no_grad():
            # pre-seeding deepcopy's memo swaps every parameter for its cast copy while the rest of the
            # tree (classes, buffers, config, tying: one memo entry per tensor) is copied as it is
            memo = {id(p): nn.Parameter(self._cast(p), requires_grad=False) for p in source.parameters()}
            self.model = copy.deepcopy(source, memo).eval()
        self._bind()

    def _cast(self, p: torch.Tensor) -> torch.Tensor:
        return p.detach().to(self.dtype) if p.is_floating_point() else p.detach().clone()

    def _bind(self) -> None:
        """Pair each source parameter with its copy by name (tied parameters once)."""
        copies = dict(self.model.named_parameters())
        self._pairs = [(src, copies[name]) for name, src in self.source.named_parameters()]
        self._sources = [src for src, _ in self._pairs]
        self._versions = [src._version for src in self._sources]

    def sync(self) -> int:
        """Re-cast the source parameters written in place since the last sync; how many were."""
        versions = [src._version for src in self._sources]  # one pass, compared as one list
        if versions == self._versions:
            return 0
        changed = 0
        for i, (src, dst) in enumerate(self._pairs):
            version = versions[i]
            if version != self._versions[i]:
                with torch.no_grad():
                    dst.copy_(src.detach())
                self._versions[i] = version
                changed += 1
        return changed

    def resync(self) -> None:
        """Re-read every parameter by name (after parameters were replaced, not written in place)."""
        copies = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, src in self.source.named_parameters():
                dst = copies[name]
                if dst.shape != src.shape:
                    raise ValueError(f"sync_weights: {name} changed shape {tuple(dst.shape)} -> {tuple(src.shape)}")
                dst.copy_(src.detach())
        self._bind()


def parse_dtype(name: str) -> torch.dtype | None:
    """``EngineConfig.weights_dtype`` -> a torch dtype (None: run the model's own weights)."""
    return None if name == "model" else getattr(torch, name)
