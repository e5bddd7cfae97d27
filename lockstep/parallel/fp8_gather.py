"""Blockwise-FP8 all-gather of a parameter sharded by whole 128-row tile-rows (issue #20).

FlexShard's ``BlockShard`` buckets hold whole tile-rows of a 2-D parameter per rank, so no
``block x block`` quantisation tile straddles two ranks. Each rank then quantises its own tiles,
the ranks all-gather the FP8 bytes and the per-tile scales (one collective), and the result is
bit-identical to gathering the full-precision rows first and quantising the full tensor: every
tile's scale and every element's FP8 value depend only on that tile's elements, computed by the
same elementwise operations on the same values wherever the tile lives. The wire carries one byte
per element plus 4 bytes per tile instead of BF16's two bytes per element (~0.5x).

Row layout (:func:`block_shard_rows`): a ``[R, C]`` parameter has ``T = ceil(R / block)``
tile-rows; with ``W`` ranks each rank owns ``k = ceil(T / W)`` consecutive tile-rows, rank ``r``
rows ``[r*k*block, min((r+1)*k*block, R))`` (possibly empty for the last ranks), and the
collective moves a fixed slot of ``k*block`` rows per rank (zero padding past the real rows).

Arithmetic (bitwise equality depends on it):

- The input is cast to fp32 (exact from bf16/fp16/fp32). Tile ``(i, j)`` covers rows
  ``[i*block, (i+1)*block)`` and columns ``[j*block, (j+1)*block)`` clipped to the tensor: edge
  tiles of shapes that are not multiples of ``block`` are partial, and only their real elements
  count (padding is zero, which cannot raise an ``amax``).
- ``amax = max |x|`` over the tile (exact). ``scale = amax / 448`` in fp32 (one IEEE division,
  round to nearest even; 448 is float8_e4m3fn's largest finite value). Rule for a zero tile (and
  for an ``amax`` so small that ``amax / 448`` underflows to 0): ``scale = 1.0``.
- ``q = (x / scale)``, a true elementwise fp32 division by the tile's scale (not a multiplication
  by a reciprocal), clamped to ``[-448, 448]`` (the quotient can round a hair past 448), then
  ``.to(torch.float8_e4m3fn)``: torch's cast, round to nearest even.
- Dequantisation: ``q.to(float32) * scale`` (the cast is exact; the product is one fp32 rounding),
  then ``.to(dtype)``.
- Error bound: e4m3 has 3 mantissa bits, so each quantised element is within half a step of
  ``x / scale``: ``|dq - x| <= 2^-4 * 2^floor(log2 |x / scale|) * scale <= 2^-4 * |x|`` for
  normal e4m3 values, and ``<= 2^-10 * scale`` (half the subnormal step 2^-9) below e4m3's
  smallest normal 2^-6; so ``|dq - x| <= max(2^-4 |x|, 2^-10 scale)`` plus one fp32 rounding of
  the product (and the final cast when ``dtype`` is narrower than fp32).
- The gathers run under ``torch.no_grad()`` (a gradient path is the caller's: FlexShard reduce-scatters
  gradients itself), and every rank must pass the same number of columns (not checked: that would
  cost a collective; a mismatch fails inside the all-gather).
- Non-finite inputs are not checked (master weights are finite): an ``inf`` gives an ``inf``
  scale and NaNs in its tile.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block: must be a positive int (a tile is block x block), got {block!r}")


def _check_matrix(name: str, w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        what = f"a {w.dim()}-D {w.dtype} tensor" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{name}: must be a 2-D floating-point tensor, got {what}")


def _tiles(w: torch.Tensor, block: int) -> torch.Tensor:
    """``w`` in fp32, zero-padded to whole tiles, as ``[R_tiles, block, C_tiles, block]``."""
    rows, cols = w.shape
    rt, ct = -(-rows // block), -(-cols // block)
    x = w.float()
    if (rt * block, ct * block) != (rows, cols):
        x = torch.nn.functional.pad(x, (0, ct * block - cols, 0, rt * block - rows))
    return x.view(rt, block, ct, block)


def quantize_blockwise(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` -> ``(float8_e4m3fn [R, C], fp32 scales [ceil(R/block), ceil(C/block)])``.

    One scale per ``block x block`` tile; the arithmetic is in the module docstring."""
    _check_block(block)
    _check_matrix("w", w)
    rows, cols = w.shape
    if w.numel() == 0:
        return (torch.empty(rows, cols, dtype=FP8_DTYPE, device=w.device),
                torch.ones(-(-rows // block), -(-cols // block), device=w.device))
    x = _tiles(w, block)
    scales = x.abs().amax(dim=(1, 3)) / FP8_MAX
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = (x / scales[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(x.shape[0] * block, x.shape[2] * block)[:rows, :cols]
    return q.contiguous(), scales


def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor, block: int = 128,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``q.float() * scale`` per tile, cast to ``dtype``."""
    _check_block(block)
    if q.dim() != 2 or q.dtype != FP8_DTYPE:
        raise ValueError(f"q: must be a 2-D {FP8_DTYPE} tensor, got {q.dim()}-D {q.dtype}")
    rows, cols = q.shape
    want = (-(-rows // block), -(-cols // block))
    if tuple(scales.shape) != want or scales.dtype != torch.float32:
        raise ValueError(f"scales: must be float32 of shape {list(want)} for q {list(q.shape)} and block "
                         f"{block}, got {scales.dtype} {list(scales.shape)}")
    full = scales.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (q.float() * full).to(dtype)


class BlockRows(NamedTuple):
    """One rank's share of a ``BlockShard`` parameter (see the module docstring)."""

    start: int  # first real row
    stop: int  # one past the last real row (== start for a rank that holds nothing)
    slot: int  # rows every rank sends (k * block), padding included
    tile_rows: int  # k, tile-rows per rank


def block_shard_rows(full_rows: int, world: int, rank: int, block: int = 128) -> BlockRows:
    """The rows ``rank`` of ``world`` owns of a ``full_rows``-row parameter: whole tile-rows."""
    _check_block(block)
    if isinstance(full_rows, bool) or not isinstance(full_rows, int) or full_rows < 1:
        raise ValueError(f"full_rows: must be a positive int, got {full_rows!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank: must be in [0, {world}), got {rank}")
    k = -(-(-(-full_rows // block)) // world)
    slot = k * block
    start = min(rank * slot, full_rows)
    return BlockRows(start, min(start + slot, full_rows), slot, k)


def shard_block_rows(w: torch.Tensor, group=None, block: int = 128) -> torch.Tensor:
    """This rank's rows of the full parameter ``w`` (a view; may have 0 rows)."""
    _check_matrix("w", w)
    rows = block_shard_rows(w.shape[0], dist.get_world_size(group), dist.get_rank(group), block)
    return w[rows.start:rows.stop]


def _local(local_rows: torch.Tensor, group, block: int, full_rows: int) -> tuple[torch.Tensor, BlockRows, int]:
    _check_block(block)
    _check_matrix("local_rows", local_rows)
    world = dist.get_world_size(group)
    rows = block_shard_rows(full_rows, world, dist.get_rank(group), block)
    n = local_rows.shape[0]
    real = rows.stop - rows.start
    if n != real and n != rows.slot:
        raise ValueError(
            f"local_rows: a BlockShard shard of {full_rows} rows over {world} ranks with block {block} has "
            f"{real} real rows on rank {dist.get_rank(group)} (rows [{rows.start}, {rows.stop}), whole "
            f"tile-rows; or {rows.slot} with the slot's padding), got {n}")
    return local_rows[:real], rows, world


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # looked up at call time so that a wrapper around torch.distributed's function sees the call
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    fn(out, inp, group=group)


@torch.no_grad()
def gather_block_rows(local_rows: torch.Tensor, group=None, block: int = 128, *, full_rows: int) -> torch.Tensor:
    """The full-precision gather of a ``BlockShard`` parameter (the baseline FP8 is measured against):
    one fixed-slot all-gather in ``local_rows.dtype``; returns ``[full_rows, C]``."""
    mine, rows, world = _local(local_rows, group, block, full_rows)
    send = local_rows.new_zeros(rows.slot, local_rows.shape[1])
    send[:mine.shape[0]] = mine
    out = send.new_empty(world * rows.slot, local_rows.shape[1])
    _all_gather(out, send, group)
    return out[:full_rows]


@torch.no_grad()
def gather_blockwise_fp8(local_rows: torch.Tensor, group=None, block: int = 128, *, full_rows: int,
                         dequantize: torch.dtype | None = None):
    """All-gather a ``BlockShard`` parameter as blockwise FP8.

    ``local_rows``: this rank's real rows ``[start, stop)`` of :func:`block_shard_rows` (or its whole
    slot, padding ignored). Each rank quantises its own tiles; the FP8 bytes and the fp32 scales
    travel as one ``uint8`` all-gather of a fixed size (gloo has no float8). Returns ``(fp8 [R, C],
    scales [ceil(R/block), ceil(C/block)])``, equal bit for bit to ``quantize_blockwise`` of the full
    tensor, or with ``dequantize=dtype`` the dequantised ``[R, C]`` tensor in ``dtype``."""
    mine, rows, world = _local(local_rows, group, block, full_rows)
    cols = local_rows.shape[1]
    ct = -(-cols // block)
    q, s = quantize_blockwise(mine, block)
    data_bytes, scale_bytes = rows.slot * cols, rows.tile_rows * ct * 4
    send = torch.zeros(data_bytes + scale_bytes, dtype=torch.uint8, device=local_rows.device)
    send[:q.numel()] = q.view(torch.uint8).flatten()
    send[data_bytes:data_bytes + s.numel() * 4] = s.view(torch.uint8).flatten()
    out = torch.empty(world, send.numel(), dtype=torch.uint8, device=send.device)
    _all_gather(out.view(-1), send, group)
    fp8 = out[:, :data_bytes].reshape(world * rows.slot, cols)[:full_rows].view(FP8_DTYPE)
    scales = out[:, data_bytes:].contiguous().view(torch.float32).reshape(world * rows.tile_rows, ct)
    scales = scales[:-(-full_rows // block)]
    if dequantize is not None:
        return dequantize_blockwise(fp8, scales, block, dequantize)
    return fp8.contiguous(), scales.contiguous()


def wire_bytes_ratio(shape: tuple[int, int], world: int, block: int = 128,
                     baseline: torch.dtype = torch.bfloat16) -> float:
    """Bytes each rank sends for the FP8 gather / for the ``baseline``-dtype gather (analytic; the
    tests measure it by wrapping the collective)."""
    rows = block_shard_rows(shape[0], world, 0, block)
    fp8 = rows.slot * shape[1] + rows.tile_rows * math.ceil(shape[1] / block) * 4
    return fp8 / (rows.slot * shape[1] * torch.empty((), dtype=baseline).element_size())
