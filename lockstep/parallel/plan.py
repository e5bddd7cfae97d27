"""``lockstep plan``: a scale dry run that sizes a cluster job from a laptop.

The model is built on the meta device (no memory is allocated, so DeepSeek-V3-671B works on a
laptop) and every parameter is placed by its module, under the layout

    world = pp x dp_replicate x dp_shard x tp        (ep is carved out of dp_shard)

* **PP** cuts ``layers`` into ``pp`` contiguous stages by count (earlier stages take the remainder,
  as :func:`lockstep.parallel.pipeline.layer_ranges`); the first stage also holds the embedding,
  the last the final norm, the head and any MTP modules. The report shows every stage and details
  the worst one (largest memory).
* **TP** (Megatron split with sequence parallel) divides the matmuls: q/k/v, w1/w3, MLA ``wq``/
  ``wq_b``/``wkv_b``, the embedding and head (vocabulary) column-wise; ``wo``/``w2`` row-wise;
  routed experts on their hidden dim (expert TP = tp). Norms, the MoE router, MLA's down
  projections (``wq_a``, ``wkv_a``) and the MTP ``proj`` stay replicated.
* **EP** gives each of ``ep`` ranks ``n_routed_experts / ep`` routed experts. The EP ranks are taken
  from the FSDP dim (ep must divide dp_shard, as torchtitan's ``dp_shard_in_ep``): experts are then
  FSDP-sharded over the remaining ``dp_shard / ep`` ranks in their own FSDP unit (on dim 1 when a
  rank holds fewer experts than that), everything else over ``dp_shard``.
* **FSDP2** shards what is left on dim 0 over ``dp_shard`` (``torch.chunk`` pieces, padded to the
  largest: the memory numbers are the padded ones, rank totals use the exact pieces). One unit per
  block (``layers.i``, ``mtp.k``) plus the root (embedding, norm, head). **HSDP** replicas
  (``dp_replicate``) each hold a full copy and all-reduce gradients across replicas.

Memory per rank (the rank with dp/ep/tp index 0 of a stage, which holds the largest shard):
parameters (``--param-dtype``), gradients (``--grad-dtype``), AdamW states (2 fp32 moments, plus an
fp32 master copy when parameters are bf16 unless ``--no-master-weights``), buffers (rope tables,
MoE selection biases: never sharded), the FSDP transient (two gathered units in the compute dtype
for prefetch, plus the unsharded gradients of one unit before its reduce-scatter) and activations:

    per block ~ tokens_mb x (sum of saved widths) x bytes / tp     (k = saved bytes / dim is printed)

where the saved widths are read off the block's modules -- for no activation checkpointing: both
norm inputs and outputs, q/k/v, the attention output (twice: SDPA output and the copy ``wo`` reads;
flash/SDPA kernels, no T^2 scores), each SwiGLU's 4 hidden tensors (w1 and w3 outputs, silu, the
product), and for a MoE the fp32 router input, the top_k gathered token copies with their expert
hidden tensors and outputs. ``selective`` keeps matmul and attention outputs plus the block input;
``full`` keeps the block input and recomputes one block at a time. The last stage adds the logits
(``tokens_mb x vocab / tp x (compute + 4 fp32) bytes``). A stage holds the activations of the
micro-batches in flight: 1 without PP, ``min(M, pp - stage)`` for 1F1B, ``M`` for GPipe.

Collectives per optimizer step of that rank, with the size of one call (the full tensor each
collective produces or consumes) and the ring traffic per rank (all-gather / reduce-scatter /
all-to-all ``(n-1)/n``, all-reduce ``2(n-1)/n``, send/recv ``1``):

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
* PP: per micro-batch the stage-boundary activations ``[mb, seq / tp, dim]`` forward and their
  gradients backward.

``--verify-fsdp`` builds the worst stage for real under a fake process group
(``init_process_group("fake")``, ``init_device_mesh("cpu", ...)``) on the meta device, applies
``fully_shard`` (and lockstep's TP plan where lockstep has one, and EP by ``distribute_tensor`` of
the routed experts), and compares every parameter's local DTensor shard shape with the plan. Where
lockstep's own ``ParallelConfig`` accepts the layout (pp = 1; TP only on dense blocks; EP as far as
lockstep supports it) it goes through lockstep's path (``ParallelDims.build_mesh`` +
``parallelize_dense``) instead, so the check covers the code the trainer runs.

Use :func:`build_plan` from Python, or ``cmd_plan(argv)`` (``lockstep plan``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lockstep.parallel.pipeline import layer_ranges  # the split the runner uses
from lockstep.config.base import ConfigError

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
SCHEDULES = ("1F1B", "GPipe")
AC_MODES = ("none", "selective", "full")
ROOT_UNIT = "root"


def _dtype(name: str, flag: str) -> str:
    key = str(name).lower()
    if key not in _DTYPE_ALIASES:
        raise ConfigError(f"{flag}: must be one of bf16, fp32 (or bfloat16, float32), got {name!r}")
    return _DTYPE_ALIASES[key]


def _fail(flag: str, message: str) -> None:
    raise ConfigError(f"{flag}: {message}")


# ----------------------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class Layout:
    """Parallel degrees. ``world = pp x dp_replicate x dp_shard x tp``; ``ep`` divides ``dp_shard``.

    Rank order (outermost first): pp, dp_replicate, dp_shard (= dp_shard/ep x ep), tp.
    """

    world: int
    pp: int = 1
    dp_replicate: int = 1
    #: -1: every rank not taken by the other degrees
    dp_shard: int = -1
    tp: int = 1
    ep: int = 1

    def resolve(self) -> "Layout":
        """The layout with ``dp_shard`` filled in; ConfigError naming the degree otherwise."""
        if self.world < 1:
            _fail("--world", f"must be >= 1, got {self.world}")
        for flag, value in (("--pp", self.pp), ("--dp-replicate", self.dp_replicate), ("--tp", self.tp),
                            ("--ep", self.ep)):
            if value < 1:
                _fail(flag, f"must be >= 1, got {value}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            _fail("--dp-shard", f"must be >= 1 or -1 (auto), got {self.dp_shard}")
        others = self.pp * self.dp_replicate * self.tp
        if self.dp_shard == -1:
            if self.world % others:
                _fail("--world", f"{self.world} is not divisible by pp={self.pp} x dp_replicate="
                      f"{self.dp_replicate} x tp={self.tp} = {others}, so --dp-shard=-1 (auto) has no whole value")
            dp_shard = self.world // others
        else:
            dp_shard = self.dp_shard
        product = others * dp_shard
        if product != self.world:
            _fail("--world", f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={dp_shard} x "
                  f"tp={self.tp} = {product}, but the world size is {self.world}")
        if dp_shard % self.ep:
            _fail("--ep", f"{self.ep} does not divide --dp-shard={dp_shard} (expert-parallel ranks are taken "
                  "from the FSDP dim; experts are FSDP-sharded over dp_shard / ep)")
        return dataclasses.replace(self, dp_shard=dp_shard)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def expert_fsdp(self) -> int:
        """FSDP degree of the routed experts (``dp_shard / ep``)."""
        return self.dp_shard // self.ep

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank (``dp_shard = dp_shard_mod_ep * ep + ep``)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world}")
        rank, tp = divmod(rank, self.tp)
        rank, dp_shard = divmod(rank, self.dp_shard)
        pp, dp_replicate = divmod(rank, self.dp_replicate)
        return {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp,
                "ep": dp_shard % self.ep, "dp_shard_mod_ep": dp_shard // self.ep}

    def first_rank_of_stage(self, stage: int) -> int:
        return stage * (self.world // self.pp)

    def describe(self) -> str:
        text = f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp}"
        if self.ep > 1:
            text += f"; ep={self.ep} inside dp_shard (experts FSDP over dp_shard/ep={self.expert_fsdp})"
        return text


# ------------------------------------------------------------------------------------- parameters
def _chunk(size: int, n: int, index: int) -> int:
    """Length of piece ``index`` of ``torch.chunk(size, n)`` along one dim (FSDP2's split)."""
    if n == 1:
        return size
    c = -(-size // n)
    return max(0, min(c, size - index * c))


@dataclasses.dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter lives: its stage, FSDP unit and the dims TP / EP / FSDP split."""

    name: str
    shape: tuple[int, ...]
    #: embedding, head, attention, mlp, router, experts, shared_experts, mtp, norm, other
    kind: str
    stage: int
    unit: str
    tp_dim: int | None
    tp: int
    ep: int
    fsdp_dim: int
    fsdp: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_expert(self) -> bool:
        return self.kind == "experts"

    def pre_fsdp_shape(self, apply_tp: bool = True) -> tuple[int, ...]:
        """The rank's TP / EP piece before FSDP sharding (what one all-gather rebuilds)."""
        shape = list(self.shape)
        if self.tp_dim is not None and apply_tp:
            shape[self.tp_dim] //= self.tp
        if self.ep > 1:
            shape[0] //= self.ep
        return tuple(shape)

    def local_shape(self, fsdp_index: int, apply_tp: bool = True) -> tuple[int, ...]:
        """Exact FSDP2 local shard shape (unpadded ``to_local()``) of FSDP index ``fsdp_index``."""
        shape = list(self.pre_fsdp_shape(apply_tp))
        if shape:
            shape[self.fsdp_dim] = _chunk(shape[self.fsdp_dim], self.fsdp, fsdp_index)
        return tuple(shape)

    def local_numel(self, fsdp_index: int) -> int:
        return math.prod(self.local_shape(fsdp_index))

    @property
    def padded_numel(self) -> int:
        """Elements of the padded shard every FSDP rank allocates."""
        shape = list(self.pre_fsdp_shape())
        if shape and self.fsdp > 1:
            shape[self.fsdp_dim] = -(-shape[self.fsdp_dim] // self.fsdp)
        return math.prod(shape)

    @property
    def gathered_numel(self) -> int:
        """Elements one FSDP all-gather of this parameter produces (padded)."""
        return self.padded_numel * self.fsdp


def _module_kinds():
    from lockstep.models.common.attention import GroupedQueryAttention
    from lockstep.models.common.mla import MultiHeadLatentAttention
    from lockstep.models.common.mlp import SwiGLU
    from lockstep.models.common.moe import MoE, GroupedExperts

    return GroupedQueryAttention, MultiHeadLatentAttention, SwiGLU, MoE, GroupedExperts


def _tp_rule(mod_name: str, mod: nn.Module, pname: str, parent: nn.Module | None,
             p: torch.Tensor) -> tuple[str, int | None]:
    """(kind, TP-split dim or None) of parameter ``pname`` of ``mod``."""
    GQA, MLA, SwiGLU, MoE, GroupedExperts = _module_kinds()
    leaf = mod_name.rsplit(".", 1)[-1]
    if isinstance(mod, nn.Embedding):
        return "embedding", 0
    if isinstance(mod, GroupedExperts):  # w1, w3 [E, F, D]; w2 [E, D, F]: split F
        return "experts", 2 if pname == "w2" else 1
    if isinstance(mod, nn.Linear):
        col = 0 if (pname == "weight" or p.dim() == 1) else None
        row = 1 if pname == "weight" else None  # a row-wise layer's bias is replicated
        if mod_name == "output":
            return "head", col
        if isinstance(parent, GQA):
            return "attention", row if leaf == "wo" else col
        if isinstance(parent, MLA):
            if leaf in ("wq_a", "wkv_a"):
                return "attention", None
            return "attention", row if leaf == "wo" else col
        if isinstance(parent, SwiGLU):
            kind = "shared_experts" if ".shared_experts" in f".{mod_name}" else "mlp"
            return kind, row if leaf == "w2" else col
        if isinstance(parent, MoE) and leaf == "gate":
            return "router", None
        return ("mtp" if mod_name.startswith("mtp.") else "other"), None
    return "norm", None


def place_parameters(model: nn.Module, layout: Layout) -> tuple[list[ParamPlacement], list[range], list[str]]:
    """Every parameter's placement under ``layout`` (shared parameters once), the stage layer
    ranges, and notes about parameters no rule knew."""
    notes: list[str] = []
    keys = list(model.layers.keys())
    ranges = layer_ranges(len(keys), layout.pp)
    stage_of_layer = {keys[i]: s for s, r in enumerate(ranges) for i in r}
    modules = dict(model.named_modules())
    last = layout.pp - 1
    seen: set[int] = set()
    out: list[ParamPlacement] = []
    unknown: list[str] = []
    for mod_name, mod in modules.items():
        parent = modules.get(mod_name.rsplit(".", 1)[0]) if "." in mod_name else None
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{pname}" if mod_name else pname
            parts = name.split(".")
            kind, tp_dim = _tp_rule(mod_name, mod, pname, parent, p)
            if kind == "other":
                unknown.append(name)
            if parts[0] == "layers":
                stage, unit = stage_of_layer[parts[1]], f"layers.{parts[1]}"
            elif parts[0] == "mtp":
                stage, unit = last, f"mtp.{parts[1]}"
            elif parts[0] == "tok_embeddings":
                stage, unit = 0, ROOT_UNIT
            else:
                stage, unit = last, ROOT_UNIT
            tp = layout.tp if tp_dim is not None else 1
            if tp_dim is not None and p.shape[tp_dim] % layout.tp:
                _fail("--tp", f"{layout.tp} does not divide dim {tp_dim} (={p.shape[tp_dim]}) of {name}")
            ep, fsdp, fsdp_dim = 1, layout.dp_shard, 0
            if kind == "experts" and layout.ep > 1:
                ep, fsdp = layout.ep, layout.expert_fsdp
                unit = f"{mod_name}"  # experts are their own FSDP unit on the dp_shard/ep mesh
                if p.shape[0] // ep < fsdp:  # fewer local experts than FSDP ranks: shard the hidden dim
                    fsdp_dim = 1
            out.append(ParamPlacement(name=name, shape=tuple(p.shape), kind=kind, stage=stage, unit=unit,
                                      tp_dim=tp_dim, tp=tp, ep=ep, fsdp_dim=fsdp_dim, fsdp=fsdp))
    if unknown:
        notes.append(f"TP-replicated (no TP rule): {_compress(unknown)}")
    return out, ranges, notes


def _compress(names: Iterable[str], limit: int = 4) -> str:
    """``layers.3.x, layers.4.x`` -> ``layers.{3..4}.x``; at most ``limit`` patterns."""
    groups: dict[str, list[int]] = {}
    for n in names:
        m = re.match(r"^(layers|mtp)\.(\d+)(.*)$", n)
        key, idx = (f"{m.group(1)}.{{}}{m.group(3)}", int(m.group(2))) if m else (n, -1)
        groups.setdefault(key, []).append(idx)
    parts = []
    for key, idx in groups.items():
        if "{}" not in key:
            parts.append(key)
            continue
        lo, hi = min(idx), max(idx)
        parts.append(key.format(str(lo) if lo == hi else f"{{{lo}..{hi}}}"))
    extra = len(parts) - limit
    return ", ".join(parts[:limit]) + (f" (+{extra} more)" if extra > 0 else "")


# ------------------------------------------------------------------------------------ activations
def _linear_out(m: nn.Module | None) -> int:
    return m.out_features if isinstance(m, nn.Linear) else 0


def _attention_widths(att: nn.Module, dim: int, ac: str) -> tuple[float, float]:
    """(saved elements per token in the compute dtype, saved fp32 bytes per token) of attention,
    excluding its norm input (counted by the block)."""
    GQA, MLA, _, _, _ = _module_kinds()
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
    _, _, SwiGLU, MoE, _ = _module_kinds()
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


# -------------------------------------------------------------------------------------- the plan
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


@dataclasses.dataclass
class StagePlan:
    """Per-rank memory of one pipeline stage (the rank with dp/ep/tp index 0: the largest shard)."""

    stage: int
    layers: range
    params: list[ParamPlacement]
    param_numel: int  # padded local elements
    param_numel_exact: int  # exact local elements of the index-0 rank
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    buffer_bytes: float
    activation_bytes: float
    fsdp_transient_bytes: float
    in_flight_microbatches: int
    units: dict[str, dict[str, Any]]
    collectives: list[Collective] = dataclasses.field(default_factory=list)

    @property
    def total_bytes(self) -> float:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes
                + self.activation_bytes + self.fsdp_transient_bytes)

    @property
    def traffic_per_step(self) -> float:
        return sum(c.traffic_per_step for c in self.collectives)

    def to_dict(self, with_collectives: bool = True) -> dict[str, Any]:
        out = {"stage": self.stage, "layers": [self.layers.start, self.layers.stop],
               "n_params": len(self.params), "param_numel_padded": self.param_numel,
               "param_numel_exact": self.param_numel_exact, "param_bytes": self.param_bytes,
               "grad_bytes": self.grad_bytes, "optimizer_bytes": self.optimizer_bytes,
               "buffer_bytes": self.buffer_bytes, "activation_bytes": self.activation_bytes,
               "fsdp_transient_bytes": self.fsdp_transient_bytes,
               "in_flight_microbatches": self.in_flight_microbatches, "total_bytes": self.total_bytes,
               "traffic_bytes_per_step": self.traffic_per_step}
        if with_collectives:
            out["fsdp_units"] = self.units
            out["collectives"] = [c.to_dict() for c in self.collectives]
        return out


@dataclasses.dataclass
class Plan:
    family: str
    flavor: str
    layout: Layout
    seq_len: int
    batch_size: int
    microbatches: int
    microbatch_size: int
    param_dtype: str
    grad_dtype: str
    compute_dtype: str
    master_weights: bool
    activation_checkpoint: str
    pp_schedule: str
    reshard_after_forward: str
    total_params: int
    active_params: int | None
    params: list[ParamPlacement]
    stages: list[StagePlan]
    activation_k: dict[str, float]
    notes: list[str]
    verify: dict[str, Any] | None = None

    @property
    def worst(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.total_bytes)

    @property
    def optimizer_bytes_per_param(self) -> int:
        return 8 + (4 if self.master_weights and self.param_dtype == "bf16" else 0)

    def rank_param_numel(self, rank: int, unique: bool = False) -> int:
        """Exact parameter elements global rank ``rank`` holds (unpadded FSDP pieces).

        ``unique``: count each element once over the world -- copies of TP-replicated parameters
        only on tp index 0, and nothing on HSDP replicas other than the first -- so the sum over all
        ranks is the model's parameter count.
        """
        c = self.layout.coords(rank)
        if unique and c["dp_replicate"]:
            return 0
        total = 0
        for p in self.stages[c["pp"]].params:
            if unique and p.tp_dim is None and c["tp"]:
                continue
            total += p.local_numel(c["dp_shard_mod_ep"] if p.ep > 1 else c["dp_shard"])
        return total

    def rank_param_bytes(self, rank: int) -> int:
        return self.rank_param_numel(rank) * DTYPE_BYTES[self.param_dtype]

    def to_dict(self) -> dict[str, Any]:
        L = self.layout
        return {
            "model": {"family": self.family, "flavor": self.flavor, "params": self.total_params,
                      "active_params_per_token": self.active_params,
                      "param_bytes": self.total_params * DTYPE_BYTES[self.param_dtype]},
            "layout": dataclasses.asdict(L) | {"dp": L.dp, "expert_fsdp": L.expert_fsdp},
            "batch": {"seq_len": self.seq_len, "global_batch": self.batch_size,
                      "tokens_per_step": self.batch_size * self.seq_len,
                      "per_dp_rank": self.batch_size // L.dp, "microbatches": self.microbatches,
                      "microbatch_size": self.microbatch_size, "pp_schedule": self.pp_schedule},
            "dtypes": {"param": self.param_dtype, "grad": self.grad_dtype, "compute": self.compute_dtype,
                       "optimizer_bytes_per_param": self.optimizer_bytes_per_param,
                       "master_weights": self.master_weights and self.param_dtype == "bf16"},
            "activation_checkpoint": self.activation_checkpoint,
            "reshard_after_forward": self.reshard_after_forward,
            "activation_k_bytes_per_token_per_dim": self.activation_k,
            "stages": [s.to_dict(with_collectives=False) for s in self.stages],
            "worst_stage": self.worst.to_dict(),
            "notes": self.notes,
            "verify_fsdp": self.verify,
        }

    def format(self) -> str:
        return _format(self)


def _microbatches(layout: Layout, batch: int, microbatches: int | None, schedule: str) -> int:
    local = batch // layout.dp
    if microbatches is None:
        if layout.pp == 1:
            return 1
        if local % layout.pp == 0:
            return layout.pp
        if local >= layout.pp or schedule == "GPipe":
            return local
        _fail("--batch-size", f"{batch} gives {local} sequence(s) per data-parallel rank, fewer than the "
              f"pp={layout.pp} micro-batches 1F1B needs: use at least {layout.pp * layout.dp}")
    if microbatches < 1:
        _fail("--microbatches", f"must be >= 1, got {microbatches}")
    if local % microbatches:
        _fail("--microbatches", f"{microbatches} does not divide the {local} sequences per data-parallel rank")
    if schedule == "1F1B" and layout.pp > 1 and microbatches < layout.pp:
        _fail("--microbatches", f"1F1B needs at least pp={layout.pp} micro-batches, got {microbatches}")
    return microbatches


def _validate_model(model: nn.Module, layout: Layout, seq_len: int) -> None:
    GQA, _, _, MoE, _ = _module_kinds()
    cfg = model.config
    n_layers = len(model.layers)
    if layout.pp > n_layers:
        _fail("--pp", f"{layout.pp} stages need at least one layer each; the model has {n_layers} layers")
    if layout.pp > 1 and cfg.tie_embeddings:
        _fail("--pp", "tied embeddings (model.tie_embeddings) put one weight on the first and the last stage; "
              "lockstep's pipeline refuses them: untie them or use pp=1")
    if layout.tp > 1:
        att = model.layers[next(iter(model.layers))].attention
        heads = [("model.n_heads", cfg.n_heads)]
        if isinstance(att, GQA):
            heads.append(("model.n_kv_heads", cfg.n_kv_heads))
        heads.append(("model.vocab_size", cfg.vocab_size))
        for name, value in heads:
            if value % layout.tp:
                _fail("--tp", f"{layout.tp} does not divide {name}={value}")
        if seq_len % layout.tp:
            _fail("--tp", f"{layout.tp} does not divide --seq-len={seq_len} (sequence parallel splits the sequence)")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if layout.ep > 1:
        if not moes:
            _fail("--ep", f"{layout.ep} > 1 but {cfg.family} {cfg.flavor} has no routed experts")
        for m in moes:
            if m.n_experts % layout.ep:
                _fail("--ep", f"{layout.ep} does not divide n_routed_experts={m.n_experts}")


def build_meta_model(config) -> nn.Module:
    """The model of ``config`` on the meta device (no storage is allocated)."""
    with torch.device("meta"):
        return config.build()


def build_plan(config, layout: Layout, *, seq_len: int, batch_size: int | None = None,
               microbatches: int | None = None, param_dtype: str = "fp32", grad_dtype: str = "fp32",
               compute_dtype: str | None = None, master_weights: bool = True, activation_checkpoint: str = "none",
               pp_schedule: str = "1F1B", reshard_after_forward: str = "always",
               model: nn.Module | None = None) -> Plan:
    """Size ``config`` (a TransformerConfig) under ``layout``; ``batch_size`` is global sequences per
    optimizer step (default: one sequence per micro-batch per data-parallel rank). Pass ``model`` (a
    meta build of ``config``) to reuse one. Raises ConfigError naming the flag that is wrong."""
    layout = layout.resolve()
    param_dtype, grad_dtype = _dtype(param_dtype, "--param-dtype"), _dtype(grad_dtype, "--grad-dtype")
    compute_dtype = _dtype(compute_dtype or param_dtype, "--compute-dtype")
    if activation_checkpoint not in AC_MODES:
        _fail("--activation-checkpoint", f"must be one of {list(AC_MODES)}, got {activation_checkpoint!r}")
    if pp_schedule not in SCHEDULES:
        _fail("--pp-schedule", f"must be one of {list(SCHEDULES)} (single-stage-per-rank schedules), "
              f"got {pp_schedule!r}")
    if reshard_after_forward not in ("always", "never"):
        _fail("--reshard-after-forward", f"must be always or never, got {reshard_after_forward!r}")
    if seq_len < 1:
        _fail("--seq-len", f"must be >= 1, got {seq_len}")
    if seq_len > config.max_seq_len:
        _fail("--seq-len", f"{seq_len} exceeds model.max_seq_len={config.max_seq_len}")
    if batch_size is None:
        batch_size = layout.dp * (microbatches or (layout.pp if layout.pp > 1 else 1))
    if batch_size < 1 or batch_size % layout.dp:
        _fail("--batch-size", f"{batch_size} is not a positive multiple of the {layout.dp} data-parallel ranks "
              f"(dp_replicate={layout.dp_replicate} x dp_shard={layout.dp_shard})")
    m_count = _microbatches(layout, batch_size, microbatches, pp_schedule)
    mb = batch_size // layout.dp // m_count

    model = build_meta_model(config) if model is None else model
    _validate_model(model, layout, seq_len)
    params, ranges, notes = place_parameters(model, layout)
    total = sum(p.numel for p in params)
    active = None
    if any(hasattr(m, "active_matmul_params") for m in model.modules()):
        active = total - sum(sum(p.numel() for p in m.parameters()) - m.active_matmul_params()
                             for m in model.modules() if hasattr(m, "active_matmul_params"))

    pb, gb, cb = DTYPE_BYTES[param_dtype], DTYPE_BYTES[grad_dtype], DTYPE_BYTES[compute_dtype]
    opt_per = 8 + (4 if master_weights and param_dtype == "bf16" else 0)
    dim, tp = config.dim, layout.tp
    tokens = mb * seq_len
    settings = dict(layout=layout, tokens=tokens, cb=cb, gb=gb, M=m_count, schedule=pp_schedule,
                    reshard=reshard_after_forward == "always")

    # activations per block kind (bytes per token, before / tp)
    block_kinds: dict[str, tuple[float, float]] = {}
    k_report: dict[str, float] = {}
    blocks = {f"layers.{k}": b for k, b in model.layers.items()}
    if getattr(model, "mtp", None) is not None:
        blocks.update({f"mtp.{k}.block": m.block for k, m in model.mtp.items()})
    for name, block in blocks.items():
        saved, transient = block_activation_bytes(block, dim, cb, activation_checkpoint)
        block_kinds[name] = (saved, transient)
        kind = "moe" if _ffn_is_moe(block) else "dense"
        k_report.setdefault(f"{kind}_block", round(saved / dim, 2))
        if activation_checkpoint == "full":
            k_report.setdefault(f"{kind}_block_recompute", round(transient / dim, 2))
    vocab = config.vocab_size
    head_bytes = 2 * dim * cb + vocab * (cb + 4)  # final norm in/out, logits + fp32 log-softmax
    k_report["head"] = round(head_bytes / dim, 2)

    buffers: dict[int, float] = {s: 0.0 for s in range(layout.pp)}
    for name, buf in model.named_buffers():
        nb = buf.numel() * buf.element_size()
        parts = name.split(".")
        if parts[0] == "layers":
            stages = [next(s for s, r in enumerate(ranges) if list(model.layers).index(parts[1]) in r)]
        elif parts[0] == "mtp":
            stages = [layout.pp - 1]
        else:  # rope tables and anything model-wide: every stage
            stages = list(range(layout.pp))
        for s in stages:
            buffers[s] += nb

    layer_keys = list(model.layers.keys())
    stages: list[StagePlan] = []
    for s, r in enumerate(ranges):
        sp = [p for p in params if p.stage == s]
        padded = sum(p.padded_numel for p in sp)
        exact = sum(p.local_numel(0) for p in sp)
        if layout.pp == 1:
            in_flight = 1
        elif pp_schedule == "GPipe":
            in_flight = m_count
        else:
            in_flight = min(m_count, layout.pp - s)
        names = [f"layers.{layer_keys[i]}" for i in r]
        if s == layout.pp - 1 and getattr(model, "mtp", None) is not None:
            names += [f"mtp.{k}.block" for k in model.mtp]
        saved = sum(block_kinds[n][0] for n in names)
        transient = max((block_kinds[n][1] for n in names), default=0.0)
        if s == layout.pp - 1:
            n_heads_out = 1 + (len(model.mtp) if getattr(model, "mtp", None) is not None else 0)
            saved += n_heads_out * head_bytes + (n_heads_out - 1) * 5 * dim * cb  # MTP: norms, concat, proj
        act = tokens * (in_flight * saved + transient) / tp
        units = _units(sp, pb, gb, cb)
        transient_fsdp = _fsdp_transient(units, reshard_after_forward == "always")
        stage = StagePlan(stage=s, layers=r, params=sp, param_numel=padded, param_numel_exact=exact,
                          param_bytes=padded * pb, grad_bytes=padded * gb, optimizer_bytes=padded * opt_per,
                          buffer_bytes=buffers[s], activation_bytes=act, fsdp_transient_bytes=transient_fsdp,
                          in_flight_microbatches=in_flight, units=units)
        stage.collectives = _collectives(stage, model, names, settings)
        stages.append(stage)

    if layout.pp > 1 and getattr(model, "mtp", None) is not None:
        notes.append("MTP modules sit on the last stage; lockstep's pipeline does not run MTP yet, and a "
                     "pipelined MTP needs the token embeddings sent from stage 0 (counted as a send/recv)")
    if layout.pp > 1 and layout.dp_shard > 1:
        notes.append("FSDP all-gathers are counted per micro-batch, forward and backward (an upper bound under "
                     "PP, where torch.distributed.pipelining keeps parameters gathered between backward "
                     "micro-batches); reduce-scatters once per step")
    if len({len(r) for r in ranges}) > 1:
        notes.append(f"{len(layer_keys)} layers do not split evenly over pp={layout.pp}: stages hold "
                     f"{[len(r) for r in ranges]} layers")
    waste = sum(p.padded_numel * p.fsdp - math.prod(p.pre_fsdp_shape()) for p in params if p.fsdp > 1)
    if waste > 0.01 * total / max(1, layout.tp):
        notes.append(f"FSDP padding: {waste / 1e6:.1f}M padded elements per shard group (dims not divisible "
                     "by the FSDP degree)")
    if layout.tp > 1 and any(p.kind in ("experts", "router") for p in params):
        notes.append("lockstep's parallelize_dense has no TP plan for MoE/MLA blocks yet (it refuses them); "
                     "this sizes the torchtitan-style plan (expert TP = tp)")
    if layout.ep > 1:
        notes.append("EP is sized as torchtitan's (ep borrowed from dp_shard, experts FSDP over dp_shard/ep, "
                     "expert TP = tp); lockstep's own EP covers part of that: --verify-fsdp says which path ran")
    return Plan(family=config.family, flavor=config.flavor, layout=layout, seq_len=seq_len, batch_size=batch_size,
                microbatches=m_count, microbatch_size=mb, param_dtype=param_dtype, grad_dtype=grad_dtype,
                compute_dtype=compute_dtype, master_weights=master_weights, activation_checkpoint=activation_checkpoint,
                pp_schedule=pp_schedule, reshard_after_forward=reshard_after_forward, total_params=total,
                active_params=active, params=params, stages=stages, activation_k=k_report, notes=notes)


def _ffn_is_moe(block: nn.Module) -> bool:
    return isinstance(block.feed_forward, _module_kinds()[3])


def _units(params: list[ParamPlacement], pb: int, gb: int, cb: int) -> dict[str, dict[str, Any]]:
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


def _fsdp_transient(units: dict[str, dict[str, Any]], reshard: bool) -> float:
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


def _collectives(stage: StagePlan, model: nn.Module, block_names: list[str], st: dict[str, Any]) -> list[Collective]:
    L: Layout = st["layout"]
    T, cb, gb, M = st["tokens"], st["cb"], st["gb"], st["M"]
    dim = model.config.dim
    out: list[Collective] = []
    rs_calls = 1 if L.pp > 1 else M

    # FSDP / HSDP, grouped by identical units
    grouped: dict[tuple, list[str]] = {}
    for name, u in stage.units.items():
        key = (u["group"], u["fsdp"], u["gathered_compute_bytes"], u["unsharded_grad_bytes"],
               u["sharded_numel"])
        grouped.setdefault(key, []).append(name)
    for (group, n, gathered, ungrad, sharded_numel), names in grouped.items():
        label = f"{_compress(names, 2)} (x{len(names)})" if len(names) > 1 else names[0]
        k = len(names)
        if n > 1:
            out.append(Collective("all-gather", group, n, f"FSDP params fwd: {label}", gathered, k * M))
            if st["reshard"]:
                out.append(Collective("all-gather", group, n, f"FSDP params bwd: {label}", gathered, k * M))
            out.append(Collective("reduce-scatter", group, n, f"FSDP grads: {label}", ungrad, k * rs_calls))
        if L.dp_replicate > 1:
            out.append(Collective("all-reduce", "dp_replicate", L.dp_replicate, f"HSDP grads: {label}",
                                  sharded_numel * gb, k * rs_calls))

    act = T * dim * cb  # one [mb, seq, dim] activation
    n_blocks = len(block_names)
    if L.tp > 1:
        out.append(Collective("all-gather", "tp", L.tp, f"TP/SP block inputs (attn + mlp) x{n_blocks} blocks",
                              act, 2 * 2 * n_blocks * M))
        out.append(Collective("reduce-scatter", "tp", L.tp, f"TP/SP block outputs (wo + w2) x{n_blocks} blocks",
                              act, 2 * 2 * n_blocks * M))
        if stage.stage == 0:
            out.append(Collective("reduce-scatter", "tp", L.tp, "TP embedding output fwd (+ all-gather bwd)",
                                  act, 2 * M))
        if stage.stage == L.pp - 1:
            heads = 1 + (len(model.mtp) if getattr(model, "mtp", None) is not None else 0)
            out.append(Collective("all-gather", "tp", L.tp, f"TP head input fwd (+ reduce-scatter bwd) x{heads}",
                                  act, 2 * heads * M))
            out.append(Collective("all-reduce", "tp", L.tp, "loss-parallel cross-entropy (max, sum-exp, target)",
                                  3 * T * 4 * heads, M))
        rep = sum(math.prod(p.pre_fsdp_shape()) for p in stage.params if p.tp_dim is None)
        if rep:
            out.append(Collective("all-reduce", "tp", L.tp, "grads of TP-replicated params (norms, router, ...)",
                                  rep * gb, M))
    if L.ep > 1:
        moe_blocks = [n for n in block_names if _ffn_is_moe(_get(model, n))]
        if moe_blocks:
            top_k = _get(model, moe_blocks[0]).feed_forward.top_k
            size = T * top_k * dim * cb
            out.append(Collective("all-to-all", "ep", L.ep,
                                  f"EP dispatch + combine, fwd + bwd, x{len(moe_blocks)} MoE layers "
                                  f"(tokens x top_k={top_k} x dim)", size, 4 * len(moe_blocks) * M))
    if L.pp > 1:
        boundary = act / L.tp
        if stage.stage > 0:
            out.append(Collective("recv", "pp", L.pp, "PP activations from the previous stage", boundary, M))
            out.append(Collective("send", "pp", L.pp, "PP activation grads to the previous stage", boundary, M))
        if stage.stage < L.pp - 1:
            out.append(Collective("send", "pp", L.pp, "PP activations to the next stage", boundary, M))
            out.append(Collective("recv", "pp", L.pp, "PP activation grads from the next stage", boundary, M))
        if getattr(model, "mtp", None) is not None and stage.stage in (0, L.pp - 1):
            first = stage.stage == 0
            out.append(Collective("send" if first else "recv", "pp", L.pp,
                                  "PP token embeddings for MTP (stage 0 -> last)", boundary, M))
            out.append(Collective("recv" if first else "send", "pp", L.pp,
                                  "PP MTP embedding grads (last -> stage 0)", boundary, M))
    return out


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


# ------------------------------------------------------------------------------------ formatting
def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _format(plan: Plan) -> str:
    L, w = plan.layout, plan.worst
    pb = DTYPE_BYTES[plan.param_dtype]
    lines = [f"lockstep plan: {plan.family} {plan.flavor} on {L.world} ranks"]
    active = f", {_fmt_count(plan.active_params)} active per token" if plan.active_params else ""
    lines.append(f"  model    {_fmt_count(plan.total_params)} params{active}; "
                 f"{fmt_bytes(plan.total_params * pb)} in {plan.param_dtype}")
    lines.append(f"  layout   {L.describe()}")
    local = plan.batch_size // L.dp
    tokens = plan.batch_size * plan.seq_len
    lines.append(f"  batch    {plan.batch_size} seqs x {plan.seq_len} = {tokens:,} tokens/step; "
                 f"{local} seqs per dp rank = {plan.microbatches} micro-batch(es) of {plan.microbatch_size}"
                 + (f" ({plan.pp_schedule})" if L.pp > 1 else ""))
    master = " + fp32 master" if plan.optimizer_bytes_per_param == 12 else ""
    lines.append(f"  dtypes   params {plan.param_dtype}, grads {plan.grad_dtype}, compute {plan.compute_dtype}; "
                 f"AdamW 2 x fp32{master} = {plan.optimizer_bytes_per_param} B/param; "
                 f"activation checkpointing: {plan.activation_checkpoint}")
    k = ", ".join(f"{name} k={v}" for name, v in plan.activation_k.items())
    lines.append(f"  act.     per block ~ seq x mb x dim x k bytes / tp ({k}); x micro-batches in flight")
    lines.append("")
    lines.append("per-rank memory by pipeline stage (dp/ep/tp index 0, the largest shard):")
    head = f"  {'stage':>5} {'layers':>8} {'params':>11} {'grads':>11} {'optim':>11} {'buffers':>10} " \
           f"{'activations':>12} {'fsdp peak':>11} {'total':>11}"
    lines.append(head)
    for s in plan.stages:
        layers = f"{s.layers.start}-{s.layers.stop - 1}"
        mark = " <- worst" if s is w and len(plan.stages) > 1 else ""
        lines.append(f"  {s.stage:>5} {layers:>8} {fmt_bytes(s.param_bytes):>11} {fmt_bytes(s.grad_bytes):>11} "
                     f"{fmt_bytes(s.optimizer_bytes):>11} {fmt_bytes(s.buffer_bytes):>10} "
                     f"{fmt_bytes(s.activation_bytes):>12} {fmt_bytes(s.fsdp_transient_bytes):>11} "
                     f"{fmt_bytes(s.total_bytes):>11}{mark}")
    lines.append(f"  worst stage {w.stage}: {_fmt_count(w.param_numel)} parameter elements per rank "
                 f"({w.in_flight_microbatches} micro-batch(es) of activations in flight)")
    lines.append("")
    lines.append(f"collectives per optimizer step on a rank of stage {w.stage}:")
    lines.append(f"  {'op':<15} {'group':<16} {'size/call':>11} {'calls':>7} {'traffic/step':>13}  what")
    for c in w.collectives:
        group = f"{c.group}({c.group_size})"
        lines.append(f"  {c.op:<15} {group:<16} {fmt_bytes(c.bytes_per_call):>11} {c.calls_per_step:>7} "
                     f"{fmt_bytes(c.traffic_per_step):>13}  {c.what}")
    lines.append(f"  total traffic per rank per step ~ {fmt_bytes(w.traffic_per_step)} (ring estimates; "
                 "plus a scalar all-reduce for grad-norm clipping)")
    for note in plan.notes:
        lines.append(f"  note: {note}")
    if plan.verify is not None:
        lines.append("")
        lines.extend(_format_verify(plan.verify))
    return "\n".join(lines)


def _format_verify(v: dict[str, Any]) -> list[str]:
    if not v.get("ok") and "error" in v:
        return [f"verify-fsdp: FAILED to build: {v['error']}"]
    lines = [f"verify-fsdp: stage {v['stage']} built under a fake process group (rank {v['rank']} of "
             f"{v['world']}, mesh {v['mesh']}, via {v['path']}) in {v['seconds']:.1f}s"]
    if v.get("lockstep_path_skipped_reason"):
        lines.append(f"  (not lockstep's own parallelize path: {v['lockstep_path_skipped_reason']})")
    skipped = "" if v["tp_applied"] or not v["tp_skipped_reason"] else f"; TP not applied: {v['tp_skipped_reason']}"
    lines.append(f"  {v['n_params']} parameters, {v['n_match']} local shard shapes match the plan{skipped}")
    lines.append(f"  local elements on this rank: {v['local_numel']:,} (plan: {v['plan_numel']:,})")
    for e in v["examples"]:
        lines.append(f"  {e['name']:<44} {str(tuple(e['shape'])):>20} -> local {str(tuple(e['local_shape'])):>18} "
                     f"{e['placements']} on {e['mesh']}")
    if v.get("hint"):
        lines.append(f"  hint: {v['hint']}")
    for m in v["mismatches"][:10]:
        lines.append(f"  MISMATCH {m['name']}: local {tuple(m['local_shape'])}, plan {tuple(m['plan_shape'])}")
    return lines


# --------------------------------------------------------------------------------- verify (fake PG)
def verify_fsdp(plan: Plan, config, stage: int | None = None) -> dict[str, Any]:
    """Build ``stage`` (default: the worst) of ``config`` on the meta device under a fake process
    group of ``plan.layout.world`` ranks, shard it, and compare local shard shapes with the plan."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    L = plan.layout
    stage = plan.worst.stage if stage is None else stage
    if not 0 <= stage < L.pp:
        _fail("--verify-stage", f"must be in [0, pp={L.pp}), got {stage}")
    if dist.is_initialized():
        raise RuntimeError("--verify-fsdp: a process group is already initialised here; run it in a fresh process")
    rank = L.first_rank_of_stage(stage)
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=L.world)
    try:
        model = build_meta_model(config)
        native, native_reason = _lockstep_parallel_config(plan, model)
        if native is not None:
            mesh_desc, tp_applied, reason = _shard_lockstep(model, plan, *native)
            path = "lockstep ParallelDims.build_mesh + parallelize_dense"
        else:
            mesh_desc, tp_applied, reason = _shard_mesh(model, plan, stage)
            path = "torchtitan-style mesh (pp, dp_replicate, dp_shard_mod_ep, ep, tp) + fully_shard"
        result = _compare(model, plan, stage, rank, tp_applied)
        if native is not None and result["mismatches"] and L.dp_shard == 1 and L.dp_replicate > 1:
            result["hint"] = ("lockstep's fsdp.dp_mesh takes the lone dp_replicate dim as the FSDP mesh, so "
                              "fully_shard shards over the replicas instead of replicating; the plan assumes "
                              "replicas hold full copies")
        result.update(ok=not result["mismatches"], stage=stage, rank=rank, world=L.world, mesh=mesh_desc,
                      path=path, lockstep_path_skipped_reason=native_reason, tp_applied=tp_applied,
                      tp_skipped_reason=reason,
                      seconds=time.perf_counter() - t0)
        return result
    finally:
        dist.destroy_process_group()


def _is_dense(model: nn.Module) -> bool:
    GQA, _, SwiGLU, _, _ = _module_kinds()
    return all(isinstance(b.attention, GQA) and isinstance(b.feed_forward, SwiGLU) for b in model.layers.values())


def _lockstep_parallel_config(plan: Plan, model: nn.Module) -> tuple[tuple[Any, Any] | None, str]:
    """(ParallelConfig, ParallelDims) when lockstep's own parallelize path covers the layout, else
    (None, why not)."""
    from lockstep.parallel.dims import ParallelConfig

    L = plan.layout
    if L.pp > 1:
        return None, "pp > 1: lockstep's ParallelConfig has no pipeline degree"
    if L.tp > 1 and not _is_dense(model):
        return None, "tp > 1 on MLA/MoE blocks: lockstep's TP plan covers GQA + SwiGLU only"
    kwargs: dict[str, Any] = dict(dp_replicate=L.dp_replicate, dp_shard=L.dp_shard, tp=L.tp,
                                  fsdp_param_dtype="bfloat16" if plan.compute_dtype == "bf16" else "float32",
                                  reshard_after_forward=plan.reshard_after_forward)
    if L.ep > 1:
        if "ep" not in {f.name for f in dataclasses.fields(ParallelConfig)}:
            return None, "ep > 1: lockstep's ParallelConfig has no expert-parallel degree"
        kwargs["ep"] = L.ep
    pcfg = ParallelConfig(**kwargs)
    try:
        dims = pcfg.resolve(L.world)
    except ConfigError as err:
        return None, f"lockstep refuses the layout: {err}"
    return (pcfg, dims), ""


def _shard_lockstep(model: nn.Module, plan: Plan, pcfg, dims) -> tuple[str, bool, str]:
    from lockstep.models.common.parallelize import parallelize_dense

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slicing a flattened dim from the root mesh
        mesh = dims.build_mesh("cpu")
        if mesh is not None:
            parallelize_dense(model, dims, mesh, pcfg)
    desc = str(dict(dims.mesh_dims)) if dims.mesh_dims else "{} (world 1)"
    return desc, plan.layout.tp > 1, ""


def _shard_mesh(model: nn.Module, plan: Plan, stage: int) -> tuple[str, bool, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from lockstep.models.common.parallelize import apply_dense_tp

    L = plan.layout
    names = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
    mesh = init_device_mesh("cpu", (L.pp, L.dp_replicate, L.expert_fsdp, L.ep, L.tp), mesh_dim_names=names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slicing a flattened dim from the root mesh
        mesh[("dp_shard_mod_ep", "ep")]._flatten("dp_shard")
        dp_mesh = mesh[("dp_replicate", "dp_shard")] if L.dp_replicate > 1 else mesh["dp_shard"]
        ep_fsdp_mesh = (mesh[("dp_replicate", "dp_shard_mod_ep")] if L.dp_replicate > 1
                        else mesh["dp_shard_mod_ep"])
    tp_applied, reason = False, ""
    if L.tp > 1:
        if _is_dense(model):
            apply_dense_tp(model, mesh["tp"])
            tp_applied = True
        else:
            reason = "lockstep has no TP plan for MLA/MoE blocks (shapes compared without the TP split)"
    # cut to the stage, as lockstep.parallel.pipeline does
    keys = list(model.layers.keys())
    keep = {keys[i] for i in layer_ranges(len(keys), L.pp)[stage]}
    for k in keys:
        if k not in keep:
            del model.layers[k]
    if stage != 0:
        model.tok_embeddings = None
    if stage != L.pp - 1:
        model.norm = None
        model.output = None
        if getattr(model, "mtp", None) is not None:
            model.mtp = None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if plan.compute_dtype == "bf16" else torch.float32,
                                  reduce_dtype=torch.float32)
    GroupedExperts = _module_kinds()[4]
    blocks = list(model.layers.values()) + (list(model.mtp.values()) if getattr(model, "mtp", None) else [])
    for block in blocks:
        for mod in block.modules():
            if isinstance(mod, GroupedExperts) and L.ep > 1:
                for w in ("w1", "w2", "w3"):
                    p = getattr(mod, w)
                    setattr(mod, w, nn.Parameter(distribute_tensor(p.data, mesh["ep"], [Shard(0)])))
                n_local = mod.n_experts // L.ep
                dim = 0 if n_local >= L.expert_fsdp else 1
                fully_shard(mod, mesh=ep_fsdp_mesh, mp_policy=policy,
                            shard_placement_fn=lambda _p, d=dim: Shard(d))
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    desc = "{" + ", ".join(f"{n}: {s}" for n, s in zip(names, mesh.shape)) + "}"
    return desc, tp_applied, reason


def _compare(model: nn.Module, plan: Plan, stage: int, rank: int, tp_applied: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    c = plan.layout.coords(rank)
    by_name = {p.name: p for p in plan.stages[stage].params}
    n, match, local_numel, plan_numel = 0, 0, 0, 0
    mismatches, examples, seen_kinds = [], [], set()
    for name, p in model.named_parameters():
        placed = by_name.get(name)
        if placed is None:
            mismatches.append({"name": name, "local_shape": list(p.shape), "plan_shape": None})
            continue
        n += 1
        local = p.to_local() if isinstance(p, DTensor) else p
        idx = c["dp_shard_mod_ep"] if placed.ep > 1 else c["dp_shard"]
        want = placed.local_shape(idx, apply_tp=tp_applied or placed.tp_dim is None)
        local_numel += local.numel()
        plan_numel += math.prod(want)
        if tuple(local.shape) == want:
            match += 1
        else:
            mismatches.append({"name": name, "local_shape": list(local.shape), "plan_shape": list(want)})
        if placed.kind not in seen_kinds:
            seen_kinds.add(placed.kind)
            examples.append({"name": name, "shape": list(p.shape), "local_shape": list(local.shape),
                             "placements": [str(x) for x in p.placements] if isinstance(p, DTensor) else [],
                             "mesh": list(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else []})
    missing = sorted(set(by_name) - {nm for nm, _ in model.named_parameters()})
    for name in missing:
        mismatches.append({"name": name, "local_shape": None, "plan_shape": list(by_name[name].local_shape(0))})
    return {"n_params": n, "n_match": match, "mismatches": mismatches, "examples": examples,
            "local_numel": local_numel, "plan_numel": plan_numel}


# ------------------------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lockstep plan", description=(
        "Scale dry run: per-rank memory and per-step collectives of a parallel layout, from a meta-device "
        "build of the model (nothing is allocated)."))
    src = p.add_argument_group("model")
    src.add_argument("--recipe", help="take model, batch, seq-len, dtypes and degrees from a recipe")
    src.add_argument("--family", help="model family (llama3, qwen3, qwen3_moe, deepseek_v3)")
    src.add_argument("--flavor", help="flavor of the family, e.g. 8B, 70B, 30B-A3B, 671B, kimi_k2")
    lay = p.add_argument_group("layout (world = pp x dp_replicate x dp_shard x tp; ep inside dp_shard)")
    lay.add_argument("--world", type=int, help="number of ranks (required unless a recipe's degrees multiply to it)")
    lay.add_argument("--pp", type=int, default=None, help="pipeline stages (default 1)")
    lay.add_argument("--dp-replicate", type=int, default=None, help="HSDP replicas (default 1)")
    lay.add_argument("--dp-shard", type=int, default=None, help="FSDP shards; -1 = the rest (default)")
    lay.add_argument("--tp", type=int, default=None, help="tensor parallel degree (default 1)")
    lay.add_argument("--ep", type=int, default=None, help="expert parallel degree, divides dp-shard (default 1)")
    run = p.add_argument_group("step")
    run.add_argument("--seq-len", type=int, help="tokens per sequence (default: recipe, else min(4096, max_seq_len))")
    run.add_argument("--batch-size", type=int, help="global sequences per optimizer step")
    run.add_argument("--microbatches", type=int, help="micro-batches per step per dp rank (default: pp, or 1)")
    run.add_argument("--pp-schedule", default="1F1B", choices=SCHEDULES)
    run.add_argument("--param-dtype", help="stored parameter dtype: bf16 or fp32 (default fp32)")
    run.add_argument("--grad-dtype", help="gradient / reduction dtype: bf16 or fp32 (default fp32)")
    run.add_argument("--compute-dtype", help="FSDP all-gather + activation dtype (default: bf16)")
    run.add_argument("--no-master-weights", action="store_true", help="no fp32 master copy for bf16 params")
    run.add_argument("--activation-checkpoint", choices=AC_MODES)
    run.add_argument("--reshard-after-forward", choices=("always", "never"))
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--verify-fsdp", action="store_true",
                     help="also build the worst stage under a fake process group and check shard shapes")
    out.add_argument("--verify-stage", type=int, help="stage to verify (default: the worst)")
    return p


def plan_from_args(argv: list[str]) -> tuple[Plan, Any, argparse.Namespace]:
    """Parse ``lockstep plan`` arguments into (plan, model config, args); raises ConfigError."""
    args = _parser().parse_args(argv)
    defaults: dict[str, Any] = {}
    if args.recipe:
        if args.family or args.flavor:
            _fail("--recipe", "give either --recipe or --family/--flavor, not both")
        from lockstep.recipes import get_recipe

        cfg = get_recipe(args.recipe).config()
        config = cfg.model
        par = cfg.parallel
        defaults = dict(dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, tp=par.tp,
                        seq_len=cfg.training.seq_len, batch_size=cfg.training.batch_size * cfg.training.grad_accum,
                        microbatches=cfg.training.grad_accum,
                        compute_dtype="bf16" if "bfloat16" in (cfg.training.dtype, par.fsdp_param_dtype) else "fp32",
                        activation_checkpoint=cfg.training.activation_checkpoint,
                        reshard_after_forward=par.reshard_after_forward
                        if par.reshard_after_forward in ("always", "never") else "always")
    else:
        if not (args.family and args.flavor):
            _fail("--family", "give --recipe NAME, or --family F and --flavor V")
        from lockstep.models.registry import model_config

        config = model_config(args.family, args.flavor)
    if args.world is None:
        _fail("--world", "the number of ranks is required")

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(args, name)
        return value if value is not None else defaults.get(name, fallback)

    layout = Layout(world=args.world, pp=pick("pp", 1), dp_replicate=pick("dp_replicate", 1),
                    dp_shard=pick("dp_shard", -1), tp=pick("tp", 1), ep=pick("ep", 1))
    microbatches = pick("microbatches", None)
    if args.recipe and args.microbatches is None and layout.pp > 1:
        microbatches = None  # the recipe's grad_accum is a no-PP setting: let PP choose
    plan = build_plan(
        config, layout, seq_len=pick("seq_len", min(4096, config.max_seq_len)), batch_size=pick("batch_size", None),
        microbatches=microbatches, param_dtype=pick("param_dtype", "fp32"), grad_dtype=pick("grad_dtype", "fp32"),
        compute_dtype=pick("compute_dtype", "bf16"), master_weights=not args.no_master_weights,
        activation_checkpoint=pick("activation_checkpoint", "none"), pp_schedule=args.pp_schedule,
        reshard_after_forward=pick("reshard_after_forward", "always"))
    return plan, config, args


def cmd_plan(argv: list[str]) -> int:
    """``lockstep plan ...``: print the plan (text or ``--json``); 0 on success, 1 if verification
    found mismatches or failed. ConfigError propagates (``lockstep`` prints it and returns 2)."""
    plan, config, args = plan_from_args(argv)
    rc = 0
    if args.verify_fsdp:
        try:
            plan.verify = verify_fsdp(plan, config, args.verify_stage)
        except ConfigError:
            raise
        except Exception as err:  # report why the real build failed instead of a traceback
            plan.verify = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        rc = 0 if plan.verify.get("ok") else 1
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.format())
    return rc


def main(argv: list[str] | None = None) -> int:
    import sys

    try:
        return cmd_plan(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"lockstep plan: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
