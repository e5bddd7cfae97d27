"""Context parallelism's sequence layout and its two attention exchanges (all-gather, ring).

The layout (causal load balancing) and the exchanges are described in :mod:`lockstep.parallel.context`,
whose :class:`~lockstep.parallel.context.ContextParallel` installs them on a model; this module holds
the tensors' side: which slice of a sequence a rank holds (``shard_positions``, ``shard_sequence``,
``unshard_sequence``, ``gather_sequence``), ``allgather_attention`` and ``ring_attention`` with their
autograd functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lockstep.ops.attention import AttentionFn

# ----------------------------------------------------------------------------- layout


def _chunk_size(seq_len: int, cp_size: int) -> int:
    if seq_len % (2 * cp_size):
        raise ValueError(f"context parallel: sequence length {seq_len} must be divisible by 2 * cp = {2 * cp_size}")
    return seq_len // (2 * cp_size)


def shard_positions(seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None
                    ) -> torch.Tensor:
    """Global positions [seq_len // cp_size] of the tokens rank ``cp_rank`` holds (chunks r, 2cp-1-r)."""
    c = _chunk_size(seq_len, cp_size)
    hi = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device),
                      torch.arange(hi * c, (hi + 1) * c, device=device)])


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced slice of a full-sequence tensor (chunks r and 2cp-1-r along ``dim``)."""
    if cp_size == 1:
        return x
    c = _chunk_size(x.shape[dim], cp_size)
    hi = 2 * cp_size - 1 - cp_rank
    return torch.cat([x.narrow(dim, cp_rank * c, c), x.narrow(dim, hi * c, c)], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence``: every rank's slice, in cp-rank order -> the full sequence."""
    n = len(shards)
    if n == 1:
        return shards[0]
    halves = [s.chunk(2, dim=dim) for s in shards]
    pieces = [halves[j][0] if j < n else halves[2 * n - 1 - j][1] for j in range(2 * n)]
    return torch.cat(pieces, dim=dim)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1) -> torch.Tensor:
    """All-gather every rank's slice and unshard (differentiable: the gradient of each slice
    returns, summed over ranks, to the rank that owns it)."""
    if _group_size(group) == 1:
        return x
    return unshard_sequence(_AllGather.apply(x, group).unbind(0), dim=dim)


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """x -> [cp, *x.shape] stacked over the group; backward reduce-scatters (sums) the gradient
    back onto the rank that sent each slice. Both collectives exist on NCCL and gloo."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        n = _group_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # gloo takes only the concatenated form
        _all_gather_single(out, x, group=group)
        return out.view(n, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter_single(out, grad.flatten(0, 1).contiguous(), group=ctx.group)
        return out, None


def _group_size(group: dist.ProcessGroup | None) -> int:
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _group_rank(group: dist.ProcessGroup | None) -> int:
    if group is None and not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# ----------------------------------------------------------------------------- all-gather attention


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        scale: float | None, inner: AttentionFn, group: dist.ProcessGroup | None,
                        cp_rank: int, cp_size: int) -> torch.Tensor:
    """Local queries over all-gathered keys/values (see module docstring)."""
    if k.shape == v.shape:  # one collective for both
        kv = gather_sequence(torch.stack([k, v]), group, dim=3)
        k_full, v_full = kv.unbind(0)
    else:  # MLA: value heads are narrower than query/key heads
        k_full, v_full = gather_sequence(k, group, dim=2), gather_sequence(v, group, dim=2)
    if not causal:
        return inner(q, k_full, v_full, causal=False, scale=scale)
    c = q.shape[2] // 2
    outs = []
    for i, chunk in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        end = (chunk + 1) * c  # queries of global chunk `chunk` see keys [0, end), bottom-right causal
        outs.append(inner(q[:, :, i * c:(i + 1) * c], k_full[:, :, :end], v_full[:, :, :end],
                          causal=True, scale=scale))
    return torch.cat(outs, dim=2)


# ----------------------------------------------------------------------------- ring attention


def _blocks(cp_rank: int, src: int, causal: bool, t: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, square-causal?) of the local block that sees keys from rank ``src``.

    Load-balanced layout, chunks A = r, B = 2cp-1-r: own keys causal over the local [A, B] (positions
    increase along it); an earlier rank's A chunk is fully visible to both of ours, its B chunk to
    neither; a later rank's A and B are fully visible to our B chunk only.
    """
    c = t // 2
    everything = slice(0, t)
    if not causal:
        return everything, everything, False
    if src == cp_rank:
        return everything, everything, True
    if src < cp_rank:
        return everything, slice(0, c), False
    return slice(c, t), everything, False


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """fp32 scores [B, Hkv, G, Tq, S] of grouped queries [B, Hkv, G, Tq, D] and keys [B, Hkv, S, D]."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        tq, sk = s.shape[-2:]
        above = torch.ones(tq, sk, dtype=torch.bool, device=s.device).triu(sk - tq + 1)
        s = s.masked_fill(above, float("-inf"))
    return s


def _block_forward(q, k, v, scale, causal):
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.unsqueeze(2))
    return out, lse


def _block_backward(q, k, v, out_grad, lse, delta, scale, causal):
    """(dq, dk, dv) of one block given the *merged* lse and delta = rowsum(dO * O)."""
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))  # [B, Hkv, G, Tq, S]
    dv = torch.matmul(p.transpose(-1, -2), out_grad).sum(2)
    dp = torch.matmul(out_grad, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2) * scale
    return dq, dk, dv


class _Ring:
    """Send to the next rank, receive from the previous one (flat buffers, async)."""

    def __init__(self, group: dist.ProcessGroup | None, cp_rank: int, cp_size: int) -> None:
        group = group or dist.group.WORLD
        self.group = group
        self.next = dist.get_global_rank(group, (cp_rank + 1) % cp_size)
        self.prev = dist.get_global_rank(group, (cp_rank - 1) % cp_size)

    def start(self, tensors: Sequence[torch.Tensor], tag: int):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        recv = torch.empty_like(flat)
        ops = [dist.P2POp(dist.isend, flat, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return dist.batch_isend_irecv(ops), recv, [t.shape for t in tensors], flat

    @staticmethod
    def finish(pending) -> list[torch.Tensor]:
        works, recv, shapes, _flat = pending  # _flat: keep the send buffer alive until done
        for w in works:
            w.wait()
        out, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            out.append(recv[offset:offset + n].view(shape))
            offset += n
        return out


_KV_TAG, _DKV_TAG = 17, 18


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, group, cp_rank, cp_size):
        b, h, t, d = q.shape
        hkv = k.shape[1]
        qg = q.float().view(b, hkv, h // hkv, t, d)
        out = lse = None
        ring = _Ring(group, cp_rank, cp_size) if cp_size > 1 else None
        kv = (k, v)
        for step in range(cp_size):
            pending = ring.start(kv, _KV_TAG) if step < cp_size - 1 else None
            src = (cp_rank - step) % cp_size
            rows, cols, sq = _blocks(cp_rank, src, causal, t)
            o_blk, l_blk = _block_forward(qg[:, :, :, rows], kv[0][:, :, cols].float(),
                                          kv[1][:, :, cols].float(), scale, sq)
            if out is None:  # step 0 is the rank's own keys: every row gets values
                out, lse = o_blk, l_blk
            else:
                l_old = lse[..., rows]
                l_new = torch.logaddexp(l_old, l_blk)
                out[..., rows, :] = (out[..., rows, :] * torch.exp(l_old - l_new).unsqueeze(-1)
                                     + o_blk * torch.exp(l_blk - l_new).unsqueeze(-1))
                lse[..., rows] = l_new
            if pending is not None:
                kv = tuple(_Ring.finish(pending))
        result = out.reshape(b, h, t, -1).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.scale, ctx.causal, ctx.group, ctx.cp_rank, ctx.cp_size = scale, causal, group, cp_rank, cp_size
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, group, cp_rank, cp_size = ctx.scale, ctx.causal, ctx.group, ctx.cp_rank, ctx.cp_size
        b, h, t, d = q.shape
        hkv = k.shape[1]
        g = h // hkv
        qg = q.float().view(b, hkv, g, t, d)
        dog = grad_out.float().reshape(b, hkv, g, t, -1)
        delta = (dog * out.float().view(b, hkv, g, t, -1)).sum(-1)
        dq = torch.zeros_like(qg)
        ring = _Ring(group, cp_rank, cp_size) if cp_size > 1 else None
        kv, dkv_pending = (k, v), None
        for step in range(cp_size):
            kv_pending = ring.start(kv, _KV_TAG) if step < cp_size - 1 else None
            src = (cp_rank - step) % cp_size
            rows, cols, sq = _blocks(cp_rank, src, causal, t)
            dq_blk, dk_blk, dv_blk = _block_backward(
                qg[:, :, :, rows], kv[0][:, :, cols].float(), kv[1][:, :, cols].float(),
                dog[:, :, :, rows], lse[..., rows], delta[..., rows], scale, sq)
            dq[:, :, :, rows] += dq_blk
            # dK/dV of the keys we hold now: what earlier ranks on the ring added, plus ours
            if dkv_pending is None:
                dk = torch.zeros(kv[0].shape, dtype=torch.float32, device=q.device)
                dv = torch.zeros(kv[1].shape, dtype=torch.float32, device=q.device)
            else:
                dk, dv = _Ring.finish(dkv_pending)
            dk[:, :, cols] += dk_blk
            dv[:, :, cols] += dv_blk
            if ring is None:
                break
            # after the last step this hands the keys' gradient to their owner (the next rank)
            dkv_pending = ring.start((dk, dv), _DKV_TAG)
            if kv_pending is not None:
                kv = tuple(_Ring.finish(kv_pending))
        if ring is not None:
            dk, dv = _Ring.finish(dkv_pending)
        return (dq.view(b, h, t, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None,
                   group: dist.ProcessGroup | None, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Pass-KV ring attention with online-softmax merge (see module docstring)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, scale, causal, group, cp_rank, cp_size)


def _no_autocast(fn):
    """Blocks are fp32 on purpose: keep an enclosing autocast from turning their matmuls to bf16."""
    def wrapper(ctx, *args):
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return fn(ctx, *args)
    return wrapper


_RingAttention.forward = staticmethod(_no_autocast(_RingAttention.forward))
_RingAttention.backward = staticmethod(_no_autocast(_RingAttention.backward))
