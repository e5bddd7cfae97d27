"""Paged KV cache: a pool of fixed-size blocks per attention layer, block tables per sequence.

Every layer owns one pool tensor per cached quantity, ``[num_blocks + 1, block_size, ...]``:

* grouped-query attention: keys and values, ``[.., block_size, n_kv_heads, head_dim]`` each, views of
  head-major storage ``[n_kv_heads, num_blocks + 1, block_size, head_dim]`` (:func:`head_major_pool`):
  a kv head's rows of a sequence's consecutive blocks are one contiguous run, which the paged decode
  kernel reads per (sequence, kv head) and the hardware prefetcher follows;
* multi-head latent attention (DeepSeek-V3): one latent, ``[.., block_size, kv_lora_rank +
  qk_rope_head_dim]`` (the normalised ``c_kv`` and the rotated shared ``k_pe``), never full K/V;
  DeepSeek-V3.2's sparse indexer adds its keys beside it, ``[.., block_size, index_head_dim]``
  (``LayerLayout.index_dim``; :meth:`LayerCache.gather_index_keys`);
* compressed attention (DeepSeek-V4; ``kind="compressed"``): one compressed entry per ``rate`` tokens,
  ``[.., entries_per_block, head_dim]``, and for CSA the indexer's compressed keys beside it; the rest
  of its state (window keys, pending windows) is per sequence (:mod:`lockstep.generate.compressed_cache`).

Block 0 is the *null block*: never handed out, it absorbs the writes of padding tokens and pads
block tables; it is only ever read at masked positions. A sequence owns whole blocks (its block
table lists them in position order), allocated when it is admitted and returned to the free list
when it finishes. Token ``p`` of a sequence lives in slot ``table[p // block_size] * block_size +
p % block_size``.

Per forward the engine calls :meth:`PagedKVCache.set_step` with the step's
:class:`StepMetadata`; the model hands ``cache.layer(name)`` to each block, whose attention calls
:meth:`LayerCache.attend` (or ``attend_latent``): store the new tokens, gather each sequence's
context through its block table (``index_select`` over whole blocks), run the layer backend's
KV-cache variant (:func:`lockstep.ops.attention.get_cached_attention`), or its paged variant for a
decode step that reads the pools in place (``AttentionBackend.paged``).

Sliding-window layers (GPT-OSS; ``LayerLayout.window > 0``) keep only the window: they have pools
of their own, and each sequence holds a ring of :func:`window_span` blocks of them (its
``window_blocks``, reserved at admission). Logical block ``j`` of the sequence lives in ring block
``j % span``, which is free again once every position of block ``j - span`` has left the window;
their block tables (:func:`window_tables`) list only the blocks that intersect the window (the null
block elsewhere, masked out by the window). A prefill starts at position 0, so these layers attend
over the new keys/values themselves and store only the positions the window still needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from lockstep.config.base import ConfigError
from lockstep.models.common.attention import GroupedQueryAttention
from lockstep.models.common.mla import MultiHeadLatentAttention
from lockstep.ops.attention import get_attention, get_cached_attention, paged_attention_kernels

NULL_BLOCK = 0


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """What one attention layer caches per token."""

    #: "kv" (keys and values per KV head), "latent" (one shared latent, MLA) or "compressed"
    #: (DeepSeek-V4: one entry of ``key_dim`` per ``rate`` tokens, plus ``index_dim`` for CSA)
    kind: str
    #: KV heads ("kv"); 1 for "latent"
    heads: int
    #: key width per head ("kv": head_dim; "latent": kv_lora_rank + qk_rope_head_dim)
    key_dim: int
    #: value width ("kv": head_dim; "latent": kv_lora_rank, the first columns of the latent)
    value_dim: int
    #: sliding window of the layer ("kv"): it caches only its last ``window`` positions; 0 for all
    window: int = 0
    #: width of the sparse indexer's cached key ("latent" with an indexer, DeepSeek-V3.2); 0: none
    index_dim: int = 0
    #: tokens per compressed entry ("compressed")
    rate: int = 0

    def elements_per_token(self) -> int:
        return (self.heads * (self.key_dim + self.value_dim) if self.kind == "kv" else self.key_dim) + self.index_dim

    def entries_per_block(self, block_size: int) -> int:
        """Cached rows per block: ``block_size`` tokens, or ("compressed") the entries whose windows
        start in the block (entry ``w`` lives in the block of its first token ``w * rate``)."""
        return -(-block_size // self.rate) if self.kind == "compressed" else block_size

    def elements_per_block(self, block_size: int) -> int:
        if self.kind == "compressed":
            return self.entries_per_block(block_size) * (self.key_dim + self.index_dim)
        return block_size * self.elements_per_token()


def layer_layouts(model: nn.Module) -> dict[str, LayerLayout]:
    """The cache layout of every block of ``model``; errors name the layer that cannot be cached."""
    layouts: dict[str, LayerLayout] = {}
    for name, block in model.layers.items():
        attn = block.attention
        path = f"layers.{name}.attention"
        if hasattr(attn, "recurrent_state_shapes"):  # linear attention: lockstep.generate.recurrent
            continue
        if hasattr(attn, "cached_compressors"):  # DeepSeek-V4: lockstep.generate.compressed_cache
            named = attn.cached_compressors()
            main, index = named.get("compressor"), named.get("indexer")
            layouts[name] = LayerLayout("compressed", 1, main.head_dim if main else 0, 0,
                                        index_dim=index.head_dim if index else 0, rate=main.rate if main else 1)
            continue
        if isinstance(attn, MultiHeadLatentAttention):
            index_dim = attn.indexer.head_dim if getattr(attn, "indexer", None) is not None else 0
            layouts[name] = LayerLayout("latent", 1, attn.kv_lora_rank + attn.qk_rope_head_dim, attn.kv_lora_rank,
                                        index_dim=index_dim)
        elif isinstance(attn, GroupedQueryAttention):
            weight = attn.wk.weight  # under tensor parallelism (a DTensor) this rank caches its KV heads only
            heads = (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0] // attn.head_dim
            layouts[name] = LayerLayout("kv", heads, attn.head_dim, attn.head_dim, attn.window)
        else:
            raise ConfigError(f"{path}: {type(attn).__name__} has no KV-cache path in lockstep's engine "
                              f"(GroupedQueryAttention, MultiHeadLatentAttention and CompressedAttention do); this "
                              f"model cannot be served by it yet")
        try:
            get_cached_attention(attn.backend_name)
        except ValueError as err:
            raise ValueError(f"{path}.backend: {err}") from None
    return layouts


@dataclasses.dataclass
class StepMetadata:
    """Where the tokens of one forward go and what they attend to (B sequences, T new tokens each)."""

    #: [B * T] cache slot of every new token, row-major (padding tokens: slots of the null block)
    slot_mapping: torch.Tensor
    #: [B, n_blocks] each sequence's blocks in position order, padded with the null block
    block_tables: torch.Tensor
    #: [B, T] absolute position of every new token (padding rows: 0)
    q_positions: torch.Tensor
    #: sliding-window layers' slot mapping and block tables (their own pools; None without such layers)
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None
    #: a prefill: every sequence starts at position 0, so the new tokens are the whole context
    fresh: bool = False


def window_span(window: int, block_size: int) -> int:
    """Ring blocks a sequence needs for a sliding window: positions ``p - window + 1 .. p`` touch at
    most ``(window - 1) // block_size + 2`` blocks."""
    return (window - 1) // block_size + 2


def window_tables(rings: torch.Tensor, latest: torch.Tensor, n_blocks: int, block_size: int,
                  window: int) -> torch.Tensor:
    """``[B, n_blocks]`` block tables of sliding-window layers: logical block ``j`` is ring block
    ``rings[b, j % span]`` where it intersects positions ``latest[b] - window + 1 .. latest[b]``,
    the null block elsewhere (``rings [B, span]``, ``latest [B]``)."""
    j = torch.arange(n_blocks)[None]
    first = (latest - window + 1).clamp(min=0)[:, None] // block_size
    live = (j >= first) & (j <= latest[:, None] // block_size)
    ring = rings.gather(1, (j % rings.shape[1]).expand(rings.shape[0], n_blocks))
    return torch.where(live, ring, 0)


def head_major_pool(blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype,
                    device: torch.device | str) -> torch.Tensor:
    """Zeros stored ``[heads, blocks, block_size, dim]``, returned as the ``[blocks, block_size, heads, dim]``
    view every reader indexes (slot ``block * block_size + row`` stays one index: block and row merge)."""
    return torch.zeros(heads, blocks, block_size, dim, dtype=dtype, device=device).permute(1, 2, 0, 3)


class BlockAllocator:
    """Free list of block ids 1..num_blocks (0 is the null block)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache: {n} blocks requested, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class LayerCache:
    """One layer's view of the cache; the model's attention calls ``attend`` / ``attend_latent``."""

    def __init__(self, owner: "PagedKVCache", layout: LayerLayout, pools: tuple[torch.Tensor, ...]) -> None:
        self.owner, self.layout, self.pools = owner, layout, pools

    def _slots_and_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        meta = self.owner.meta
        if self.layout.window:
            return meta.window_slot_mapping, meta.window_block_tables
        return meta.slot_mapping, meta.block_tables

    def _store(self, pool: torch.Tensor, new: torch.Tensor) -> None:
        """Write ``new [B, T, ...]`` at the step's slots."""
        new = new.reshape(-1, *pool.shape[2:]).to(pool.dtype)
        if self.layout.kind == "kv":
            # a head-major view: indexed by (block, row), which a compiled step writes in place (an
            # index_copy_ through the flattened view made Inductor copy the whole pool back every call)
            pool[self.owner.slot_rows(bool(self.layout.window))] = new
        else:
            pool.view(-1, *pool.shape[2:]).index_copy_(0, self._slots_and_tables()[0], new)

    def _store_and_gather(self, pool: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Write ``new [B, T, ...]`` at the step's slots; return the contexts ``[B, S, ...]``."""
        self._store(pool, new)
        tables = self._slots_and_tables()[1]
        b, n_blocks = tables.shape
        return pool.index_select(0, tables.reshape(-1)).reshape(b, n_blocks * pool.shape[1], *pool.shape[2:])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str,
               scale: float | None = None, **sink_window: Any) -> torch.Tensor:
        """q [B, H, T, D], new k/v [B, Hkv, T, D] -> attention over each whole context [B, H, T, D].

        A decode step of a backend with a paged variant (``sdpa`` on CPU) reads the context in place
        from the pools (:mod:`lockstep.ops.paged_attention`) instead of gathering it. ``sink_window``:
        the ``sinks`` / ``window`` keywords of :mod:`lockstep.ops.attention` (GPT-OSS), for the kernels
        that take them (a paged kernel without them is skipped)."""
        k_pool, v_pool = self.pools
        paged = self.owner.paged.get(backend)
        if sink_window and paged is not None and not paged.sinks_and_windows:
            paged = None
        meta = self.owner.meta
        if self.layout.window and meta.fresh:  # prefill from position 0: the new tokens are the context
            self._store(k_pool, k.transpose(1, 2))
            self._store(v_pool, v.transpose(1, 2))
            return get_cached_attention(backend)(q, k, v, q_positions=meta.q_positions, scale=scale, **sink_window)
        if paged is not None and paged.usable(q, k_pool, v_pool):
            self._store(k_pool, k.transpose(1, 2))
            self._store(v_pool, v.transpose(1, 2))
            return paged.attend(q, k_pool, v_pool, self._slots_and_tables()[1], meta.q_positions, scale,
                                **sink_window)
        k_ctx = self._store_and_gather(k_pool, k.transpose(1, 2)).transpose(1, 2)
        v_ctx = self._store_and_gather(v_pool, v.transpose(1, 2)).transpose(1, 2)
        fn = get_cached_attention(backend)
        return fn(q, k_ctx.to(q.dtype), v_ctx.to(q.dtype), q_positions=self.owner.meta.q_positions, scale=scale,
                  **sink_window)

    def attend_latent(self, q: torch.Tensor, latent: torch.Tensor, *, value_dim: int, backend: str,
                      scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, T, W], new latent [B, T, W] -> [B, H, T, value_dim] (one shared key/value head:
        keys are the latents, values their first ``value_dim`` columns). ``mask`` [B, 1, T, S]: the
        keys each query may see (DeepSeek-V3.2's indexer selection, within the query's positions),
        run on the backend's full-sequence kernel with that mask."""
        ctx = self._store_and_gather(self.pools[0], latent).unsqueeze(1).to(q.dtype)  # [B, 1, S, W]
        if mask is not None:
            return get_attention(backend)(q, ctx, ctx[..., :value_dim], causal=False, mask=mask, scale=scale)
        fn = get_cached_attention(backend)
        return fn(q, ctx, ctx[..., :value_dim], q_positions=self.owner.meta.q_positions, scale=scale)


    @property
    def q_positions(self) -> torch.Tensor:
        """[B, T] absolute position of every new token of the current step."""
        return self.owner.meta.q_positions

    def gather_index_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Store the sparse indexer's new keys [B, T, index_dim]; return each context's [B, S, index_dim]
        (the same block tables as the latent, so key s holds position s)."""
        if not self.layout.index_dim:
            raise ValueError("KV cache: this layer's layout caches no indexer keys (LayerLayout.index_dim = 0)")
        return self._store_and_gather(self.pools[1], keys)


class PagedKVCache:
    """Block pools for every layer of a model, the allocator, and the current step's metadata."""

    def __init__(self, layouts: dict[str, LayerLayout], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", *, in_place_decode: bool = True,
                 window_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"KV cache: need at least one block, got {num_blocks}")
        #: the widest sliding window of any layer (0: none), the ring each sequence holds for it, and
        #: the allocator of the sliding layers' own pools (``window_blocks`` blocks; module docstring)
        self.window = max((lay.window for lay in layouts.values()), default=0)
        self.window_span = window_span(self.window, block_size) if self.window else 0
        if self.window and window_blocks < self.window_span:
            raise ValueError(f"KV cache: sliding-window layers need >= {self.window_span} blocks, got {window_blocks}")
        self.window_allocator = BlockAllocator(window_blocks) if self.window else None
        self.layouts, self.num_blocks, self.block_size, self.dtype = layouts, num_blocks, block_size, dtype
        #: backend name -> its paged decode variant, for those whose kernel runs on this device; decided
        #: here, outside any compiled region, since building a kernel is not traceable
        self.paged = paged_attention_kernels(torch.device(device)) if in_place_decode else {}
        #: decode steps read K/V in place from the pools (for the backends in ``paged``)
        self.in_place_decode = bool(self.paged)
        self.allocator = BlockAllocator(num_blocks)
        self.meta: StepMetadata | None = None
        self._slot_rows: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        self._layers: dict[str, LayerCache] = {}
        for name, lay in layouts.items():
            shape = ((window_blocks if lay.window else num_blocks) + 1, block_size)
            # zeros: slots read only under a mask must still be finite (0 x NaN would poison softmax @ V)
            if lay.kind == "compressed":  # entries and indexer keys (either may be 0 wide)
                shape = (num_blocks + 1, lay.entries_per_block(block_size))
                pools = (torch.zeros(*shape, lay.key_dim, dtype=dtype, device=device),
                         torch.zeros(*shape, lay.index_dim, dtype=dtype, device=device))
                self._layers[name] = LayerCache(self, lay, pools)
                continue
            if lay.kind == "kv":
                pools = (head_major_pool(*shape, lay.heads, lay.key_dim, dtype, device),
                         head_major_pool(*shape, lay.heads, lay.value_dim, dtype, device))
            else:
                pools = (torch.zeros(*shape, lay.key_dim, dtype=dtype, device=device),)
            if lay.index_dim:  # DeepSeek-V3.2: the indexer's keys beside the latent
                pools += (torch.zeros(*shape, lay.index_dim, dtype=dtype, device=device),)
            self._layers[name] = LayerCache(self, lay, pools)

    @staticmethod
    def bytes_per_block(layouts: dict[str, LayerLayout], block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return element * sum(lay.elements_per_block(block_size) for lay in layouts.values())

    @staticmethod
    def sizes(layouts: dict[str, LayerLayout], block_size: int, dtype: torch.dtype, max_batch_size: int
              ) -> tuple[int, int, int]:
        """``(bytes per block of the full-context layers, blocks of the sliding-window pools, their
        bytes)``: a ring per batch slot for the sliding layers, the rest of a budget for the others."""
        window = max((lay.window for lay in layouts.values()), default=0)
        full = {n: lay for n, lay in layouts.items() if not lay.window} or layouts
        if not window:
            return PagedKVCache.bytes_per_block(full, block_size, dtype), 0, 0
        windowed = {n: lay for n, lay in layouts.items() if lay.window}
        blocks = max_batch_size * window_span(window, block_size)
        return (PagedKVCache.bytes_per_block(full, block_size, dtype), blocks,
                blocks * PagedKVCache.bytes_per_block(windowed, block_size, dtype))

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for lc in self._layers.values() for p in lc.pools)

    def layer(self, name: str) -> LayerCache:
        return self._layers[name]

    def set_step(self, meta: StepMetadata) -> None:
        """Take the step's metadata; also split its slots into the ``(block, row)`` index pairs that the
        head-major pools are written through (:meth:`slot_rows`), here, outside any compiled region."""
        self.meta = meta
        self._slot_rows = {False: (meta.slot_mapping // self.block_size, meta.slot_mapping % self.block_size)}
        if meta.window_slot_mapping is not None:
            slots = meta.window_slot_mapping
            self._slot_rows[True] = (slots // self.block_size, slots % self.block_size)

    def slot_rows(self, window: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's slots as ``(block, row)`` index tensors (the sliding-window layers' with ``window``)."""
        return self._slot_rows[window]
