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
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lockstep.config.base import ConfigError
from lockstep.ops.attention import (AttentionFn, AttentionLayer, attention_layers, get_attention,
                                    set_attention_wrapper)
from lockstep.parallel.context_attention import (  # noqa: F401  (the layout is part of this module's API)
    _group_rank, _group_size, allgather_attention, gather_sequence, ring_attention, shard_positions,
    shard_sequence, unshard_sequence)

METHODS = ("allgather", "ring")


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

