"""DeepSeek-V4's compressed-attention state in the engine, beside the paged cache.

A :class:`~lockstep.models.common.compressed_attention.CompressedAttention` block reads, per query,
the keys of the last ``sliding_window`` positions and its layer's compressed entries (one per
``rate`` tokens; CSA picks among them with its indexer, which has compressed keys of its own). What
one sequence carries from step to step:

* **compressed entries** and the CSA **indexer keys**: they grow with the sequence, so they live in
  the paged cache (``LayerLayout`` kind ``"compressed"``, :mod:`lockstep.generate.cache`): entry ``w``
  is stored in the block of its window's first token ``w * rate`` (row ``(w * rate % block_size) //
  rate`` of it), so the sequence's own block table addresses them and nothing is allocated apart;
* fixed-size per-sequence rings (slots like :mod:`lockstep.generate.recurrent`'s, one per running
  sequence plus the null slot 0 that padding rows use): the rotated keys of the last
  ``sliding_window`` positions (position ``p`` in ring row ``p % window``) and, for each compressor,
  the projections (``kv_proj``, ``gate_proj``) of its last ``span`` positions (``span = rate``, CSA
  ``2 * rate``: an entry pools its window and, overlapping, its predecessor's).

A step hands a row ``T`` new tokens at positions ``start .. end - 1`` (a prefill or prefill chunk,
or one decode token); padding tokens are those the step's slot mapping sends to the null block.
:meth:`CompressedLayerCache.window_keys` returns the ring's keys then the new ones with the mask of
each query's window. :meth:`CompressedLayerCache.compressor_windows` lays the ring's projections
before the new ones and gathers the windows that close in this step (``w`` in ``[start // rate,
end // rate)``, at most ``ceil(T / rate)`` a row); the model pools them
(:meth:`~lockstep.models.common.kv_compressor.KVCompressor.pool`, as its whole-sequence forward does)
and :meth:`CompressedLayerCache.store_entries` writes them to the pool and returns every entry the
row's block table reaches (``n_blocks * block_size // rate``; later ones are masked by causality).
Rings are written after they are read, with only each row's last ``span`` (window) positions.

The engine holds this cache where a hybrid model's recurrent state would be (``Engine.recurrent``):
the slot bookkeeping, ``set_step`` and ``keep_only`` are :class:`RecurrentStateCache`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from lockstep.generate.recurrent import RecurrentStateCache


def compressed_layers(model: nn.Module) -> dict[str, Any]:
    """Block name -> its attention, for the blocks with DeepSeek-V4 compressed attention."""
    return {name: block.attention for name, block in model.layers.items()
            if hasattr(block.attention, "cached_compressors")}


@dataclasses.dataclass
class Windows:
    """The windows a step closes, per row: ``kv``/``gate [B, W, rate, width]`` (projections of the
    window's tokens), ``prev_kv``/``prev_gate`` those of its predecessor (CSA; gate ``-inf`` before
    position 0), ``ids [B, W]`` window numbers, ``ok [B, W]`` whether the window closed in this step, ``rate``
    tokens per window."""

    kv: torch.Tensor
    gate: torch.Tensor
    ids: torch.Tensor
    ok: torch.Tensor
    rate: int
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None


class CompressedLayerCache:
    """One compressed-attention layer's view; see the module docstring."""

    def __init__(self, owner: "CompressedStateCache", name: str, window: torch.Tensor,
                 rings: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.owner, self.name, self.window, self.rings = owner, name, window, rings

    @property
    def q_positions(self) -> torch.Tensor:
        """[B, T] absolute position of every new token of the current step."""
        return self.owner.paged.meta.q_positions

    def window_keys(self, kv: torch.Tensor, sliding_window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New rotated keys ``kv [B, T, K]`` -> (the ring's keys then the new ones ``[B, R + T, K]``,
        which of them each query sees ``[B, T, R + T]``); the new keys are then kept in the ring."""
        o = self.owner
        span = self.window.shape[1]
        ring = self.window.index_select(0, o.rows).to(kv.dtype)
        held = o.start[:, None] - 1 - (o.start[:, None] - 1 - o.arange(span)) % span  # position of ring row j
        keys = torch.cat([ring, kv], dim=1)
        key_pos = torch.cat([held, o.positions], dim=1)
        key_ok = torch.cat([held >= 0, o.valid], dim=1)
        distance = o.positions.unsqueeze(-1) - key_pos.unsqueeze(-2)
        allowed = (distance >= 0) & (distance < sliding_window) & key_ok.unsqueeze(1)
        o.ring_write(self.window, kv)
        return keys, allowed

    def compressor_windows(self, name: str, kv: torch.Tensor, gate: torch.Tensor, rate: int,
                           overlap: bool) -> Windows:
        """The windows of compressor ``name`` closed by this step's projections ``kv``/``gate [B, T, width]``."""
        o = self.owner
        ring_kv, ring_gate = self.rings[name]
        span, width, t = ring_kv.shape[1], kv.shape[-1], kv.shape[1]
        # the timeline of each row: positions start - span .. start + T - 1 (ring first, then the new tokens)
        order = ((o.start[:, None] - span + o.arange(span)) % span).unsqueeze(-1).expand(-1, -1, width)
        line_kv = torch.cat([ring_kv.index_select(0, o.rows).gather(1, order).to(kv.dtype), kv], dim=1)
        line_gate = torch.cat([ring_gate.index_select(0, o.rows).gather(1, order).to(gate.dtype), gate], dim=1)
        ids = o.start[:, None] // rate + o.arange(-(-t // rate))  # [B, W]
        ok = ids < (o.end // rate)[:, None]
        first = ids.unsqueeze(-1) * rate + o.arange(rate)  # [B, W, rate] positions of each window's tokens

        def take(line: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            index = (positions - o.start[:, None, None] + span).clamp(0, span + t - 1).flatten(1)
            picked = line.gather(1, index.unsqueeze(-1).expand(-1, -1, width))
            return picked.view(*positions.shape, width)

        windows = Windows(take(line_kv, first), take(line_gate, first), ids, ok, rate)
        if overlap:
            prev = first - rate
            windows.prev_kv = take(line_kv, prev)
            windows.prev_gate = take(line_gate, prev).masked_fill((prev < 0).unsqueeze(-1), float("-inf"))
        o.ring_write(ring_kv, kv)
        o.ring_write(ring_gate, gate)
        return windows

    def store_entries(self, name: str, entries: torch.Tensor, windows: Windows) -> torch.Tensor:
        """Store the closed windows' ``entries [B, W, D]``; return each row's entries ``[B, C, D]``."""
        paged = self.owner.paged
        pool = paged.layer(self.name).pools[0 if name == "compressor" else 1]  # [blocks + 1, per_block, D]
        tables, bs, per_block, dim = paged.meta.block_tables, paged.block_size, pool.shape[1], pool.shape[-1]
        rate = windows.rate
        start = windows.ids * rate
        block = tables.gather(1, (start // bs).clamp(max=tables.shape[1] - 1))
        slots = torch.where(windows.ok, block * per_block + start % bs // rate, 0)  # elsewhere: the null block
        pool.view(-1, dim).index_copy_(0, slots.reshape(-1), entries.reshape(-1, dim).to(pool.dtype))
        b, n_blocks = tables.shape
        context = pool.index_select(0, tables.reshape(-1)).view(b, n_blocks * per_block, dim)
        n_entries = n_blocks * bs // rate
        if per_block * rate != bs:  # entries are not contiguous in the gathered blocks
            w = torch.arange(n_entries, device=context.device) * rate
            return context.index_select(1, w // bs * per_block + w % bs // rate).to(entries.dtype)
        return context[:, :n_entries].to(entries.dtype)


class CompressedStateCache(RecurrentStateCache):
    """Per-sequence rings of every compressed-attention layer, beside the paged cache (module docstring)."""

    def __init__(self, mixers: dict[str, Any], max_sequences: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__({}, max_sequences, dtype, device)
        for name, attn in mixers.items():
            rings = {key: tuple(torch.zeros(max_sequences + 1, comp.rate * (2 if comp.overlap else 1),
                                            comp.kv_proj.out_features, dtype=dtype, device=device) for _ in range(2))
                     for key, comp in attn.cached_compressors().items()}
            window = torch.zeros(max_sequences + 1, attn.sliding_window, attn.head_dim, dtype=dtype, device=device)
            self.layers[name] = CompressedLayerCache(self, name, window, rings)
        self.paged: Any = None

    @classmethod
    def for_model(cls, model: nn.Module, max_sequences: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> "CompressedStateCache | None":
        """The cache of ``model``'s compressed-attention layers, or None when it has none."""
        mixers = compressed_layers(model)
        return cls(mixers, max_sequences, dtype, device) if mixers else None

    def wrap(self, paged: Any) -> Any:
        self.paged = paged
        return super().wrap(paged)

    @property
    def nbytes(self) -> int:
        tensors = [t for lc in self.layers.values() for t in (lc.window, *(x for r in lc.rings.values() for x in r))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def set_step(self, seq_ids: list[int], lengths: torch.Tensor | None = None, rows: int | None = None,
                 fresh: bool = False) -> None:
        """As :meth:`RecurrentStateCache.set_step` (after the paged cache's ``set_step``); also each
        row's real tokens (their slots are not the null block's), first position and end."""
        super().set_step(seq_ids, lengths, rows, fresh)
        meta = self.paged.meta
        self.positions = meta.q_positions
        b, t = self.positions.shape
        self.valid = meta.slot_mapping.view(b, t) >= self.paged.block_size  # null-block slots: padding
        self.start = self.positions[:, 0]
        self.end = self.start + self.valid.sum(1)

    def arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.device)

    def ring_write(self, ring: torch.Tensor, new: torch.Tensor) -> None:
        """Keep the new per-token rows ``new [B, T, X]`` of the step's real tokens among each row's
        last ``span`` positions in ``ring [slots, span, X]`` (row ``position % span``)."""
        span = ring.shape[1]
        keep = self.valid & (self.positions >= (self.end - span)[:, None])
        index = torch.where(keep, self.rows[:, None] * span + self.positions % span, 0)  # else the null slot
        ring.view(-1, ring.shape[-1]).index_copy_(0, index.reshape(-1), new.reshape(-1, new.shape[-1]).to(ring.dtype))


__all__ = ["CompressedLayerCache", "CompressedStateCache", "Windows", "compressed_layers"]
