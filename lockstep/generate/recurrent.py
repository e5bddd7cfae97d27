"""Per-sequence recurrent state of linear-attention layers (Gated DeltaNet), beside the paged KV cache.

A linear-attention layer carries no per-token cache: each sequence has one fixed-size state per
layer, the last ``conv_kernel - 1`` inputs of its causal convolution (``[C, K-1]``, model dtype) and
its delta-rule state (``[H, Dk, Dv]``, fp32). :class:`RecurrentStateCache` holds them in pools with
one slot per running sequence (``max_batch_size`` slots plus slot 0, the null slot that padding
rows of a compiled decode batch read and write). A sequence gets a slot when it is prefilled (the
state starts from zeros) and the slot is freed with the sequence and reused by the next one.

Per forward the engine calls :meth:`RecurrentStateCache.set_step` with the step's sequence ids and,
for a prefill, each row's real token count (prompts are right-padded into one batch: the layer
zeroes ``g`` and ``beta`` of padding tokens so they leave the state untouched, and takes the conv
window ending at the row's last real token). :meth:`RecurrentStateCache.wrap` gives the model a
cache whose ``layer(name)`` is a :class:`RecurrentLayerCache` for linear layers and the paged KV
cache's layer for full-attention ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class RecurrentLayerCache:
    """One linear-attention layer's view: ``recurrent_state()`` / ``set_recurrent_state()``."""

    def __init__(self, owner: "RecurrentStateCache", conv: torch.Tensor, state: torch.Tensor) -> None:
        self.owner, self.conv, self.state = owner, conv, state

    def recurrent_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window ``[B, C, K-1]``, delta-rule state ``[B, H, Dk, Dv]``) of the step's rows."""
        rows = self.owner.rows
        if self.owner.fresh:  # a prefill starts every sequence from zeros
            return (self.conv.new_zeros(rows.shape[0], *self.conv.shape[1:]),
                    self.state.new_zeros(rows.shape[0], *self.state.shape[1:]))
        return self.conv.index_select(0, rows), self.state.index_select(0, rows)

    def valid_lengths(self) -> torch.Tensor | None:
        """Real tokens per row of this step (right-padded prefill), or None when all are real."""
        return self.owner.lengths

    def set_recurrent_state(self, conv: torch.Tensor, state: torch.Tensor) -> None:
        rows = self.owner.rows
        self.conv.index_copy_(0, rows, conv.to(self.conv.dtype))
        self.state.index_copy_(0, rows, state.to(self.state.dtype))


class _ModelCache:
    """What ``Transformer.trunk(cache=...)`` is handed: ``layer(name)`` from either cache."""

    def __init__(self, paged: Any, recurrent: "RecurrentStateCache") -> None:
        self.paged, self.recurrent = paged, recurrent

    def layer(self, name: str) -> Any:
        layer = self.recurrent.layers.get(name)
        return layer if layer is not None else self.paged.layer(name)


def recurrent_layers(model: nn.Module) -> dict[str, Any]:
    """Block name -> its token mixer, for the blocks whose mixer keeps a recurrent state."""
    return {name: block.attention for name, block in model.layers.items()
            if hasattr(block.attention, "recurrent_state_shapes")}


class RecurrentStateCache:
    """State pools of every linear-attention layer, slots per sequence; see the module docstring."""

    def __init__(self, mixers: dict[str, Any], max_sequences: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.max_sequences = max_sequences
        self.layers: dict[str, RecurrentLayerCache] = {}
        for name, mixer in mixers.items():
            conv_shape, state_shape = mixer.recurrent_state_shapes()
            self.layers[name] = RecurrentLayerCache(
                self, torch.zeros(max_sequences + 1, *conv_shape, dtype=dtype, device=device),
                torch.zeros(max_sequences + 1, *state_shape, dtype=torch.float32, device=device))
        self._free = list(range(max_sequences, 0, -1))  # pop() hands out low slots first; 0 is the null slot
        self._slot: dict[int, int] = {}
        self.device = torch.device(device)
        self.rows = torch.zeros(0, dtype=torch.long, device=self.device)
        self.lengths: torch.Tensor | None = None
        self.fresh = False

    @classmethod
    def for_model(cls, model: nn.Module, max_sequences: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> "RecurrentStateCache | None":
        """The cache of ``model``'s linear-attention layers, or None when it has none."""
        mixers = recurrent_layers(model)
        return cls(mixers, max_sequences, dtype, device) if mixers else None

    def wrap(self, paged: Any) -> _ModelCache:
        return _ModelCache(paged, self)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for lc in self.layers.values() for t in (lc.conv, lc.state))

    def set_step(self, seq_ids: list[int], lengths: torch.Tensor | None = None, rows: int | None = None,
                 fresh: bool = False) -> None:
        """The step's rows: ``seq_ids`` in batch order (new ids get a slot), padded to ``rows`` with
        the null slot; ``lengths`` real tokens per row (prefill), ``fresh`` start from zeros."""
        slots = [self._slot[s] if s in self._slot else self._assign(s) for s in seq_ids]
        slots += [0] * ((rows or len(slots)) - len(slots))
        self.rows = torch.tensor(slots, dtype=torch.long).to(self.device)
        self.lengths = None if lengths is None else lengths.to(self.device)
        self.fresh = fresh

    def _assign(self, seq_id: int) -> int:
        if not self._free:
            raise RuntimeError(f"recurrent state: all {self.max_sequences} slots are in use")
        self._slot[seq_id] = slot = self._free.pop()
        return slot

    def keep_only(self, seq_ids: Iterable[int]) -> None:
        """Free the slots of every sequence not in ``seq_ids`` (finished or aborted)."""
        keep = set(seq_ids)
        for seq_id in [s for s in self._slot if s not in keep]:
            self._free.append(self._slot.pop(seq_id))
