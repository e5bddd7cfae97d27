"""Context parallelism: each of ``cp`` ranks holds a slice of every sequence, attention spans them all.

Layout (causal load balancing): a sequence of ``T`` tokens is cut into ``2 * cp`` chunks of
``C = T / (2 cp)`` and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, in that order. Under a
causal mask every rank then does the same attention work (an early chunk is paired with a late one).
Its global positions (``shard_positions``) go to the model as ``positions=`` so RoPE is right.

Attention across shards, two exchanges (both exact, both autograd-correct, GQA and MLA shapes):

* ``"allgather"``: keys/values are all-gathered over the cp group (one collective for both) by an
  autograd function whose backward reduce-scatters dK/dV back onto the owning rank. Each local
  query chunk ``c`` then attends the key prefix ``[0, (c+1) C)`` through the module's own attention
  backend with ``causal=True``,
  whose bottom-right alignment is exactly the causal mask by global position. No mask tensor is built.
* ``"ring"``: keys/values travel around the ring (P2P, the next step's transfer in flight while this
  step computes); partial results are merged with an online softmax (log-sum-exp). A custom
  ``autograd.Function`` recomputes each block in backward and sends dK/dV around the ring back to
  their owner, so only q, k, v, out and lse are kept for backward, never the full K/V. Blocks are
  computed in fp32 with plain matmuls (portable CPU/GPU, not a fused kernel).

The layout is implied by shapes (local length ``T / cp`` and the cp rank), so nothing has to be set per
step and the sequence length may change between steps.

Install on a model from outside (``ContextParallel.install``): CP becomes the attention wrapper of
every attention layer (``GroupedQueryAttention``, MLA; :func:`lockstep.ops.attention.set_attention_wrapper`),
so each layer's own kernel (whatever it resolves to, the batch-invariant one included) runs inside
CP; ``uninstall`` removes it. Distributed, ``install`` also makes the model's auxiliary losses
whole-sequence (MoE sequence balance loss and bias counts, DeepSeek MTP across the shard boundary:
:mod:`lockstep.parallel.context_losses`) and refuses recurrent sequence mixers (Gated DeltaNet).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lockstep.config.base import ConfigError
from lockstep.ops.attention import (AttentionFn, AttentionLayer, attention_layers, get_attention,
                                    set_attention_wrapper)

METHODS = ("allgather", "ring")


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


# ----------------------------------------------------------------------------- the context object


def refuse_unsupported_mixers(model: nn.Module) -> None:
    """ConfigError naming ``parallel.cp`` for a block context parallel cannot shard: a recurrent sequence
    mixer (Gated DeltaNet), or attention with sinks or a sliding window. The planner asks the same."""
    blocks = dict(getattr(model, "layers", {}).items())
    blocks.update({f"mtp.{k}.block": layer.block for k, layer in (getattr(model, "mtp", None) or {}).items()})
    for name, block in blocks.items():
        mixer = getattr(block, "attention", None)
        if mixer is not None and not isinstance(mixer, AttentionLayer):
            where = name if name.startswith("mtp") else f"layers.{name}"
            family = getattr(getattr(model, "config", None), "family", "this model")
            raise ConfigError(
                f"parallel.cp: context parallel shards each sequence across ranks, but {where}.attention is a "
                f"{type(mixer).__name__} (a recurrence: its state would have to pass from rank to rank along the "
                f"sequence), which context parallel does not support; use parallel.cp=1 for {family}")
        if mixer is not None and (getattr(mixer, "sinks", None) is not None or getattr(mixer, "window", 0)):
            where = name if name.startswith("mtp") else f"layers.{name}"
            raise ConfigError(
                f"parallel.cp: {where}.attention has attention sinks or a sliding window (GPT-OSS), which the "
                f"context-parallel attention (all-gather / ring) does not implement yet; use parallel.cp=1")


class ContextParallel:
    """Context parallelism over ``group`` (None: the default group, or world 1 when not distributed).

    ``method``: "allgather" (keys/values all-gathered, each module's own kernel) or "ring"
    (pass-KV ring, fp32 blockwise math). ``inner``: kernel used by ``attention`` itself (installed on a
    model, :meth:`wrap` runs each layer's own kernel instead).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, method: str = "allgather",
                 inner: str | AttentionFn = "sdpa") -> None:
        if method not in METHODS:
            raise ValueError(f"context parallel: unknown method {method!r}; choose from {list(METHODS)}")
        self.group, self.method = group, method
        self.rank, self.size = _group_rank(group), _group_size(group)
        self.inner = get_attention(inner) if isinstance(inner, str) else inner

    # -- data -------------------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return shard_sequence(x, self.rank, self.size, dim)

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """[1, seq_len // cp] global positions of this rank's tokens: pass as ``model(..., positions=)``."""
        return shard_positions(seq_len, self.rank, self.size, device)[None]

    def shard_batch(self, inputs: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, targets, positions) of this rank from full [B, T] inputs and (already shifted) targets."""
        return self.shard(inputs), self.shard(targets), self.positions(inputs.shape[1], inputs.device)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Full sequence from every rank's slice (differentiable)."""
        return gather_sequence(x, self.group, dim)

    # -- attention --------------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                  mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """Attention backend signature; q, k, v are this rank's slices [B, H(kv), T/cp, D]."""
        return self._attention(q, k, v, causal=causal, mask=mask, scale=scale, inner=self.inner)

    def wrap(self, inner: AttentionFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
             mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """The attention wrapper ``install`` puts on every layer: CP around the layer's kernel ``inner``."""
        return self._attention(q, k, v, causal=causal, mask=mask, scale=scale, inner=inner)

    def _attention(self, q, k, v, *, causal, mask, scale, inner):
        if mask is not None:
            raise NotImplementedError("context parallel attention takes no explicit mask (causal or full only)")
        if self.size == 1:
            return inner(q, k, v, causal=causal, scale=scale)
        if q.shape[2] != k.shape[2] or q.shape[2] % 2:
            raise ValueError(f"context parallel attention needs equal, even local query/key lengths; "
                             f"got q {tuple(q.shape)}, k {tuple(k.shape)} (cached decode is not supported)")
        if self.method == "ring":
            return ring_attention(q, k, v, causal=causal, scale=scale, group=self.group,
                                  cp_rank=self.rank, cp_size=self.size)
        return allgather_attention(q, k, v, causal=causal, scale=scale, inner=inner, group=self.group,
                                   cp_rank=self.rank, cp_size=self.size)

    # -- installing on a model ----------------------------------------------------------------------
    def install(self, model: nn.Module) -> int:
        """Make CP (:meth:`wrap`) the attention wrapper of every attention layer; returns how many.
        Distributed (cp > 1), the MoE layers' whole-sequence loss and count hooks are set too
        (:mod:`lockstep.parallel.context_losses`). A sequence mixer that is not attention (a
        recurrence) is refused: its state would have to pass from rank to rank along the sequence."""
        refuse_unsupported_mixers(model)
        layers = list(attention_layers(model))
        if not layers:
            raise ValueError("context parallel: the model has no attention layer (an ops.attention.AttentionLayer)")
        if any(layer.attention_wrapper is not None for layer in layers):
            raise RuntimeError("context parallel: an attention wrapper is already installed on this model")
        if self.size > 1:
            from lockstep.parallel.context_losses import install_auxiliary

            install_auxiliary(model, self)
        return set_attention_wrapper(model, self.wrap)

    @staticmethod
    def uninstall(model: nn.Module) -> int:
        """Remove the attention wrappers (and loss hooks) ``install`` set; returns how many layers had one."""
        from lockstep.parallel.context_losses import remove_auxiliary

        count = sum(layer.attention_wrapper is not None for layer in attention_layers(model))
        set_attention_wrapper(model, None)
        remove_auxiliary(model)
        return count

    @contextlib.contextmanager
    def installed(self, model: nn.Module) -> Iterator[nn.Module]:
        self.install(model)
        try:
            yield model
        finally:
            self.uninstall(model)

    # -- loss and gradients -------------------------------------------------------------------------
    def mtp_shift(self, tokens: torch.Tensor, positions: torch.Tensor, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MTP depth ``k``'s (tokens, targets, positions) for this rank's positions (a model hook)."""
        from lockstep.parallel.context_losses import mtp_shift

        return mtp_shift(tokens, positions, k, self.group)

    def report_auxiliary(self, losses: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole-sequence values (detached) of this rank's auxiliary-loss parts: summed over cp."""
        if self.size == 1:
            return {k: v.detach() for k, v in losses.items()}
        from lockstep.parallel.context_losses import report_auxiliary

        return report_auxiliary(losses, self.group)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(local part, global mean) of next-token CE over the whole sequence from sharded logits.

        local part = this rank's token sum / tokens counted on all cp ranks: backpropagate it, then
        SUM-reduce gradients over cp (``all_reduce_grads``). global mean (detached) = sum of local parts.
        """
        total = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index,
                                reduction="sum")
        count = (targets != ignore_index).sum().to(torch.float64)
        if self.size > 1:
            dist.all_reduce(count, group=self.group)
        from torch.distributed.tensor import DTensor

        count = count.clamp(min=1).to(total.dtype)
        if isinstance(total, DTensor):  # tp's loss-parallel CE: a replicated DTensor; keep ``local`` one
            count = DTensor.from_local(count, total.device_mesh, total.placements, run_check=False)
        local = total / count
        value = (local.to_local() if isinstance(local, DTensor) else local).detach().clone()
        if self.size > 1:
            dist.all_reduce(value, group=self.group)
        return local, value

    @torch.no_grad()
    def all_reduce_grads(self, params: Iterable[nn.Parameter]) -> None:
        """SUM every gradient over the cp group in one flat bucket per dtype (DTensor: its local shard,
        which cp peers hold for the same slice)."""
        if self.size == 1:
            return
        from torch.distributed.tensor import DTensor

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

