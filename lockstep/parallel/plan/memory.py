"""Per-rank memory pieces of a ``lockstep plan`` dry run: activations and FSDP buffers.

Activations per block ~ ``tokens_mb x (sum of saved widths) x bytes / tp``, where the saved widths
are read off the block's modules -- for no activation checkpointing: both norm inputs and outputs,
q/k/v, the attention output (twice: SDPA output and the copy ``wo`` reads; flash/SDPA kernels, no
T^2 scores), each SwiGLU's 4 hidden tensors (w1 and w3 outputs, silu, the product), and for a MoE
the fp32 router input, the top_k gathered token copies with their expert hidden tensors and
outputs. ``selective`` keeps matmul and attention outputs plus the block input; ``full`` keeps the
block input and recomputes one block at a time.

FSDP units (:func:`fsdp_units`) and the FSDP transient (:func:`fsdp_transient_bytes`): two gathered units
in the compute dtype for prefetch, plus the unsharded gradients of one unit before its
reduce-scatter.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lockstep.models.common.attention import GroupedQueryAttention as GQA
from lockstep.models.common.mla import MultiHeadLatentAttention as MLA
from lockstep.models.common.mlp import SwiGLU
from lockstep.models.common.moe import MoE
from lockstep.parallel.plan.layout import ParamPlacement


def _linear_out(m: nn.Module | None) -> int:
    return m.out_features if isinstance(m, nn.Linear) else 0


def _attention_widths(att: nn.Module, dim: int, ac: str) -> tuple[float, float]:
    """(saved elements per token in the compute dtype, saved fp32 bytes per token) of attention,
    excluding its norm input (counted by the block)."""
    if isinstance(att, GQA):
        q, kv, o = att.n_heads * att.head_dim, att.n_kv_heads * att.head_dim, att.n_heads * att.head_dim
        lse = 4 * att.n_heads
        if ac == "selective":  # mm outputs q, k, v, wo; the SDPA output
            return q + 2 * kv + o + dim, lse
        qk_norm = (q + kv) if att.q_norm is not None else 0
        return dim + q + 2 * kv + qk_norm + 2 * o, lse  # normed x, q/k/v (+ pre-norm q/k), SDPA out, wo input
    if isinstance(att, MLA):
        h, qk, v = att.n_heads, att.qk_head_dim, att.v_head_dim
        lse = 4 * h
        if ac == "selective":
            q = (att.q_lora_rank + _linear_out(att.wq_b)) if att.q_lora_rank else _linear_out(att.wq)
            return q + _linear_out(att.wkv_a) + _linear_out(att.wkv_b) + h * v + dim, lse
        q_latent = 2 * att.q_lora_rank if att.q_lora_rank else 0  # wq_a output and its norm
        kv_latent = (att.kv_lora_rank + att.qk_rope_head_dim) + att.kv_lora_rank  # wkv_a output, normed latent
        return dim + q_latent + kv_latent + 2 * h * qk + 2 * h * v, lse  # q, k, v, SDPA out, wo input
    width = sum(_linear_out(m) for m in att.modules())  # unknown kind: every matmul output
    return dim + width, 0.0


def _ffn_widths(ffn: nn.Module, dim: int, ac: str) -> tuple[float, float]:
    """Same as :func:`_attention_widths` for a feed-forward (dense SwiGLU or MoE)."""
    if isinstance(ffn, SwiGLU):
        f = ffn.w1.out_features
        return (2 * f + dim, 0.0) if ac == "selective" else (dim + 4 * f, 0.0)
    if isinstance(ffn, MoE):
        k, e = ffn.top_k, ffn.n_experts
        f = ffn.experts.hidden_dim
        fp32 = 4 * dim + 4 * e  # router input upcast to fp32, its logits / scores
        shared = 0.0
        if ffn.shared_experts is not None:
            shared = _ffn_widths(ffn.shared_experts, dim, ac)[0] - (0 if ac == "selective" else dim)
        if ac == "selective":  # loop experts: F.linear (mm) outputs are saved
            return k * (2 * f + dim) + shared, fp32
        return dim + k * (dim + 4 * f + dim) + shared, fp32  # normed x, per routed copy: token, hidden, out
    width = sum(_linear_out(m) for m in ffn.modules())
    return dim + width, 0.0


def block_activation_bytes(block: nn.Module, dim: int, compute_bytes: int, ac: str) -> tuple[float, float]:
    """(saved bytes per token kept until backward, transient bytes per token while recomputing)
    of one transformer block (before dividing by tp)."""
    a_el, a_fp32 = _attention_widths(block.attention, dim, "none" if ac == "full" else ac)
    f_el, f_fp32 = _ffn_widths(block.feed_forward, dim, "none" if ac == "full" else ac)
    if ac == "selective":
        saved = (dim + a_el + f_el) * compute_bytes + a_fp32 + f_fp32  # + the block input
    else:
        saved = (2 * dim + a_el + f_el) * compute_bytes + a_fp32 + f_fp32  # + both norm inputs
    if ac == "full":
        return dim * compute_bytes, saved
    return saved, 0.0


def fsdp_units(params: list[ParamPlacement], pb: int, gb: int, cb: int) -> dict[str, dict[str, Any]]:
    """FSDP units of a stage (``layers.i``, ``mtp.k``, root): sharded / gathered numel and bytes per rank."""
    units: dict[str, dict[str, Any]] = {}
    for p in params:
        u = units.setdefault(p.unit, {"fsdp": p.fsdp, "group": "dp_shard/ep" if p.ep > 1 else "dp_shard",
                                      "n_params": 0, "sharded_numel": 0, "gathered_numel": 0,
                                      "tp_replicated_numel": 0})
        u["n_params"] += 1
        u["sharded_numel"] += p.padded_numel
        u["gathered_numel"] += p.gathered_numel
        if p.tp_dim is None:
            u["tp_replicated_numel"] += p.gathered_numel
    for u in units.values():
        u["sharded_param_bytes"] = u["sharded_numel"] * pb
        u["gathered_compute_bytes"] = u["gathered_numel"] * cb
        u["unsharded_grad_bytes"] = u["gathered_numel"] * gb
    return units


def fsdp_transient_bytes(units: dict[str, dict[str, Any]], reshard: bool) -> float:
    """Gathered-parameter and unsharded-gradient buffers FSDP holds at its peak."""
    sharded = [u for u in units.values() if u["fsdp"] > 1]
    if not sharded:
        return 0.0
    gathered = sorted((u["gathered_compute_bytes"] for u in sharded), reverse=True)
    if not reshard:  # every unit stays gathered after forward
        params = sum(gathered)
    else:  # the current unit plus the prefetched next one
        params = sum(gathered[:2])
    return params + max(u["unsharded_grad_bytes"] for u in sharded)
