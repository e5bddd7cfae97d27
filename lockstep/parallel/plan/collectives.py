"""Collectives per optimizer step of one rank in a ``lockstep plan`` dry run.

Each :class:`Collective` has the size of one call (the full tensor it produces or consumes) and
the ring traffic per rank (all-gather / reduce-scatter / all-to-all ``(n-1)/n``, all-reduce
``2(n-1)/n``, send/recv ``1``):

* FSDP: all-gather of each unit in forward and again in backward (``reshard_after_forward``) per
  micro-batch; reduce-scatter of its gradients per micro-batch without PP (lockstep's grad-accum
  loop syncs every micro-batch), once per step under PP (torch.distributed.pipelining defers it to
  the last micro-batch).
* HSDP: all-reduce of each unit's sharded gradients across the ``dp_replicate`` replicas.
* TP (Megatron SP): per block 2 all-gathers + 2 reduce-scatters of ``[mb, seq, dim]`` forward and
  again backward; the embedding reduce-scatters its output and the head all-gathers its input;
  loss-parallel cross-entropy all-reduces 3 fp32 scalars per token; gradients of TP-replicated
  parameters are all-reduced over tp.
* EP: per MoE layer and micro-batch an all-to-all dispatch and combine of ``tokens x top_k x dim``
  forward, and both again backward (uniform routing assumed for the traffic).
* PP: per micro-batch and stage boundary of the rank's stages, the activations ``[mb, seq / cp / tp,
  dim]`` forward and their gradients backward; the embedding copy of the last stage (MTP, tied
  head) all-reduces its gradient with the first stage's once per step.
* CP: ``allgather`` all-gathers each attention layer's K/V over cp per micro-batch forward and
  reduce-scatters their gradients backward; ``ring`` sends the local K/V ``cp - 1`` times forward
  and K/V plus dK/dV ``cp - 1`` times backward. Gradients of cp-replicated parameters are
  all-reduced over cp once per step (experts excluded when ep spans cp).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from torch import nn

from lockstep.parallel.plan.layout import Layout, compress_names, ffn_is_moe

if TYPE_CHECKING:
    from lockstep.parallel.plan.build import StagePlan


@dataclasses.dataclass
class Collective:
    op: str
    group: str
    group_size: int
    what: str
    bytes_per_call: float
    calls_per_step: int

    @property
    def traffic_factor(self) -> float:
        n = self.group_size
        if self.op == "all-reduce":
            return 2 * (n - 1) / n
        if self.op in ("send", "recv"):
            return 1.0
        return (n - 1) / n

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_per_call * self.calls_per_step

    @property
    def traffic_per_step(self) -> float:
        return self.bytes_per_step * self.traffic_factor

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "group": self.group, "group_size": self.group_size, "what": self.what,
                "bytes_per_call": self.bytes_per_call, "calls_per_step": self.calls_per_step,
                "traffic_bytes_per_rank_per_step": self.traffic_per_step}


def step_collectives(stage: StagePlan, model: nn.Module, block_names: list[str],
                     st: dict[str, Any]) -> list[Collective]:
    """The collectives of one optimizer step on ``stage`` (FSDP, TP, EP, PP), from the settings ``st``."""
    L: Layout = st["layout"]
    T, cb, gb, M = st["tokens"], st["cb"], st["gb"], st["M"]
    dim = model.config.dim
    out: list[Collective] = []
    rs_calls = 1 if L.pp > 1 else M
    ids = st.get("rank_stages", [[s] for s in range(L.pp)])[stage.stage]
    n_stages = st.get("n_stages", L.pp)

    # FSDP / HSDP, grouped by identical units
    grouped: dict[tuple, list[str]] = {}
    for name, u in stage.units.items():
        key = (u["group"], u["fsdp"], u["gathered_compute_bytes"], u["unsharded_grad_bytes"],
               u["sharded_numel"])
        grouped.setdefault(key, []).append(name)
    for (group, n, gathered, ungrad, sharded_numel), names in grouped.items():
        label = f"{compress_names(names, 2)} (x{len(names)})" if len(names) > 1 else names[0]
        k = len(names)
        if n > 1:
            out.append(Collective("all-gather", group, n, f"FSDP params fwd: {label}", gathered, k * M))
            if st["reshard"]:
                out.append(Collective("all-gather", group, n, f"FSDP params bwd: {label}", gathered, k * M))
            out.append(Collective("reduce-scatter", group, n, f"FSDP grads: {label}", ungrad, k * rs_calls))
        if L.dp_replicate > 1:
            out.append(Collective("all-reduce", "dp_replicate", L.dp_replicate, f"HSDP grads: {label}",
                                  sharded_numel * gb, k * rs_calls))
        if L.cp > 1 and not (group == "dp_shard/ep" and L.ep_spans_cp):
            out.append(Collective("all-reduce", "cp", L.cp, f"CP grads: {label}", sharded_numel * gb, k))

    act = T * dim * cb  # one [mb, seq, dim] activation
    n_blocks = len(block_names)
    if L.tp > 1:
        out.append(Collective("all-gather", "tp", L.tp, f"TP/SP block inputs (attn + mlp) x{n_blocks} blocks",
                              act, 2 * 2 * n_blocks * M))
        out.append(Collective("reduce-scatter", "tp", L.tp, f"TP/SP block outputs (wo + w2) x{n_blocks} blocks",
                              act, 2 * 2 * n_blocks * M))
        if 0 in ids:
            out.append(Collective("reduce-scatter", "tp", L.tp, "TP embedding output fwd (+ all-gather bwd)",
                                  act, 2 * M))
        if n_stages - 1 in ids:
            heads = 1 + (len(model.mtp) if getattr(model, "mtp", None) is not None else 0)
            out.append(Collective("all-gather", "tp", L.tp, f"TP head input fwd (+ reduce-scatter bwd) x{heads}",
                                  act, 2 * heads * M))
            out.append(Collective("all-reduce", "tp", L.tp, "loss-parallel cross-entropy (max, sum-exp, target)",
                                  3 * T * 4 * heads, M))
        rep = sum(math.prod(p.pre_fsdp_shape()) for p in stage.params if p.tp_dim is None and p.kind != "vision")
        if rep:
            out.append(Collective("all-reduce", "tp", L.tp, "grads of TP-replicated params (norms, router, ...)",
                                  rep * gb, M))
        tower = getattr(model, "visual", None)
        if tower is not None and any(p.kind == "vision" for p in stage.params):
            # the tower's parameter gradients are not reduced: its output's gradient is (bwd, every rank's
            # visual positions); sized as if every position held an image token (an upper bound)
            features = 1 + len(getattr(tower, "deepstack_merger_list", ()))
            out.append(Collective("all-reduce", "tp", L.tp, f"vision tower output grads (bwd, x{features} "
                                  "features; upper bound: every position an image token)", act * features, M))
    if L.ep > 1:
        moe_blocks = [n for n in block_names if ffn_is_moe(_get(model, n))]
        if moe_blocks:
            top_k = _get(model, moe_blocks[0]).feed_forward.top_k
            size = T * top_k * dim * cb
            out.append(Collective("all-to-all", "ep", L.ep,
                                  f"EP dispatch + combine, fwd + bwd, x{len(moe_blocks)} MoE layers "
                                  f"(tokens x top_k={top_k} x dim)", size, 4 * len(moe_blocks) * M))
    if L.cp > 1:
        attn = [_get(model, n).attention for n in block_names]
        kv = sum(_kv_width(a) for a in attn) / L.tp  # K/V elements per token over the rank's layers
        if kv:
            if st.get("cp_method", "allgather") == "allgather":
                out.append(Collective("all-gather", "cp", L.cp, f"CP K/V fwd x{len(attn)} attention layers",
                                      T * L.cp * kv * cb / len(attn), len(attn) * M))
                out.append(Collective("reduce-scatter", "cp", L.cp, f"CP dK/dV bwd x{len(attn)} attention layers",
                                      T * L.cp * kv * cb / len(attn), len(attn) * M))
            else:
                out.append(Collective("send", "cp", L.cp, f"CP ring K/V fwd (+ K/V, dK/dV bwd) x{len(attn)} layers",
                                      T * kv * cb / len(attn), 3 * (L.cp - 1) * len(attn) * M))
    if L.pp > 1:
        boundary = act / L.tp
        sends = sum(1 for s in ids if s < n_stages - 1)
        recvs = sum(1 for s in ids if s > 0)
        if recvs:
            out.append(Collective("recv", "pp", L.pp, "PP activations from the previous stage", boundary, recvs * M))
            out.append(Collective("send", "pp", L.pp, "PP activation grads to the previous stage", boundary, recvs * M))
        if sends:
            out.append(Collective("send", "pp", L.pp, "PP activations to the next stage", boundary, sends * M))
            out.append(Collective("recv", "pp", L.pp, "PP activation grads from the next stage", boundary, sends * M))
        copy = [p for p in stage.params if p.kind in ("embedding", "embedding_copy")]
        has_copy = any(p.kind == "embedding_copy" for p in st.get("all_params", stage.params))
        if copy and has_copy:
            numel = sum(p.padded_numel for p in copy)
            out.append(Collective("all-reduce", "pp first+last", 2,
                                  "shared embedding grads (MTP / tied head copy), first <-> last stage",
                                  numel * gb, 1))
    return out


def _kv_width(att: nn.Module) -> int:
    """K and V elements per token one attention layer's cp exchange moves (before tp)."""
    from lockstep.models.common.attention import GroupedQueryAttention as GQA
    from lockstep.models.common.mla import MultiHeadLatentAttention as MLA

    if isinstance(att, GQA):
        return 2 * att.n_kv_heads * att.head_dim
    if isinstance(att, MLA):
        return att.n_heads * (att.qk_head_dim + att.v_head_dim)
    return 0


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)
