"""The layout of a ``lockstep plan`` dry run and where every parameter lives under it.

    world = pp x dp_replicate x dp_shard x cp x tp   (ep is carved out of dp_shard, or spans dp_shard x cp)

* **PP** cuts ``layers`` into ``pp x stages_per_rank(schedule)`` contiguous stages (even by count,
  by the cost model, or given sizes: :func:`lockstep.parallel.pipeline_stage.split_sizes`); pipeline
  rank ``r`` holds the stages :func:`lockstep.parallel.pipeline.stage_ids_for_rank` gives it (two
  under Interleaved1F1B / ZBV / DualPipeV). The first stage also holds the embedding, the last the
  final norm, the head and any MTP modules -- plus a copy of the embedding when MTP or a tied head
  needs it there (its gradient all-reduced with the first stage's, as the runner does).
* **CP** splits each sequence over ``cp`` ranks: parameters are replicated over cp (FSDP does not
  shard over it) and their gradients all-reduced over cp; activations are ``seq / cp`` per rank.
* **TP** (Megatron split with sequence parallel) divides the matmuls: q/k/v, w1/w3, MLA ``wq``/
  ``wq_b``/``wkv_b``, the embedding and head (vocabulary) column-wise; ``wo``/``w2`` row-wise;
  routed experts on their hidden dim (expert TP = tp). Norms, the MoE router, MLA's down
  projections (``wq_a``, ``wkv_a``) and the MTP ``proj`` stay replicated.
* **EP** gives each of ``ep`` ranks ``n_routed_experts / ep`` routed experts. The EP ranks are taken
  from the FSDP dim (ep divides dp_shard, as torchtitan's ``dp_shard_in_ep``): experts are then
  FSDP-sharded over the remaining ``dp_shard / ep`` ranks in their own FSDP unit (on dim 1 when a
  rank holds fewer experts than that), everything else over ``dp_shard``; under HSDP the experts
  are replicated over ``dp_replicate``. With cp, ep may instead span ``dp_shard x cp`` (ep ==
  dp_shard x cp): every rank then owns its experts whole (no expert FSDP).
* **FSDP2** shards what is left on dim 0 over ``dp_shard`` (``torch.chunk`` pieces, padded to the
  largest: the memory numbers are the padded ones, rank totals use the exact pieces). One unit per
  block (``layers.i``, ``mtp.k``) plus the root (embedding, norm, head). **HSDP** replicas
  (``dp_replicate``) each hold a full copy and all-reduce gradients across replicas.

Also the dtype / flag helpers the other plan modules share (:func:`parse_dtype`, :func:`flag_error`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import NoReturn

import torch
from torch import nn

from lockstep.models.common.attention import GroupedQueryAttention as GQA
from lockstep.models.common.gated_deltanet import GatedDeltaNet
from lockstep.models.common.mla import MultiHeadLatentAttention as MLA
from lockstep.models.common.mlp import SwiGLU
from lockstep.models.common.moe import GroupedExperts, MoE
from lockstep.parallel.pipeline import (SCHEDULES, last_stage_pp_rank, layer_ranges,  # noqa: F401  (SCHEDULES re-exported)
                                        stage_ids_for_rank, stages_per_rank)
from lockstep.parallel.pipeline_stage import split_sizes
from lockstep.config.base import ConfigError

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
AC_MODES = ("none", "selective", "full", "regions")
ROOT_UNIT = "root"


def parse_dtype(name: str, flag: str) -> str:
    """The canonical dtype name (``fp32`` / ``bf16``) of ``name``; a ConfigError naming ``flag`` otherwise."""
    key = str(name).lower()
    if key not in _DTYPE_ALIASES:
        raise ConfigError(f"{flag}: must be one of bf16, fp32 (or bfloat16, float32), got {name!r}")
    return _DTYPE_ALIASES[key]


def flag_error(flag: str, message: str) -> NoReturn:
    """Raise the ConfigError of a wrong command-line flag (``--flag: message``)."""
    raise ConfigError(f"{flag}: {message}")


# ----------------------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class Layout:
    """Parallel degrees. ``world = pp x dp_replicate x dp_shard x cp x tp``; ``ep`` divides
    ``dp_shard`` or equals ``dp_shard x cp``.

    Rank order (outermost first, as :meth:`lockstep.parallel.dims.ParallelDims.mesh_dims`): pp,
    dp_replicate, dp_shard (= dp_shard/ep x ep), cp, tp.
    """

    world: int
    pp: int = 1
    dp_replicate: int = 1
    #: -1: every rank not taken by the other degrees
    dp_shard: int = -1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    def resolve(self) -> "Layout":
        """The layout with ``dp_shard`` filled in; ConfigError naming the degree otherwise."""
        if self.world < 1:
            flag_error("--world", f"must be >= 1, got {self.world}")
        for flag, value in (("--pp", self.pp), ("--dp-replicate", self.dp_replicate), ("--tp", self.tp),
                            ("--ep", self.ep), ("--cp", self.cp)):
            if value < 1:
                flag_error(flag, f"must be >= 1, got {value}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            flag_error("--dp-shard", f"must be >= 1 or -1 (auto), got {self.dp_shard}")
        others = self.pp * self.dp_replicate * self.tp * self.cp
        if self.dp_shard == -1:
            if self.world % others:
                flag_error("--world", f"{self.world} is not divisible by pp={self.pp} x dp_replicate="
                           f"{self.dp_replicate} x cp={self.cp} x tp={self.tp} = {others}, so --dp-shard=-1 (auto) "
                           "has no whole value")
            dp_shard = self.world // others
        else:
            dp_shard = self.dp_shard
        product = others * dp_shard
        if product != self.world:
            flag_error("--world", f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={dp_shard} x "
                       f"cp={self.cp} x tp={self.tp} = {product}, but the world size is {self.world}")
        if dp_shard % self.ep and not (self.cp > 1 and self.ep == dp_shard * self.cp):
            flag_error("--ep", f"{self.ep} does not divide --dp-shard={dp_shard}" +
                       (f" and is not dp_shard x cp = {dp_shard * self.cp}" if self.cp > 1 else "") +
                       " (expert-parallel ranks are taken from the FSDP dim, or span dp_shard x cp)")
        return dataclasses.replace(self, dp_shard=dp_shard)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def ep_spans_cp(self) -> bool:
        """ep borrows the cp ranks too: ep == dp_shard x cp (as :class:`ParallelDims`)."""
        return self.ep > 1 and self.cp > 1 and self.ep == self.dp_shard * self.cp

    @property
    def expert_fsdp(self) -> int:
        """FSDP degree of the routed experts (``dp_shard / ep``; 1 when ep spans dp_shard x cp)."""
        return 1 if self.ep_spans_cp else self.dp_shard // self.ep

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank (``dp_shard = dp_shard_mod_ep * ep + ep``)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world}")
        rank, tp = divmod(rank, self.tp)
        rank, cp = divmod(rank, self.cp)
        rank, dp_shard = divmod(rank, self.dp_shard)
        pp, dp_replicate = divmod(rank, self.dp_replicate)
        if self.ep_spans_cp:
            ep, mod = dp_shard * self.cp + cp, 0
        else:
            ep, mod = dp_shard % self.ep, dp_shard // self.ep
        return {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp,
                "ep": ep, "dp_shard_mod_ep": mod}

    def first_rank_of_stage(self, stage: int) -> int:
        return stage * (self.world // self.pp)

    def describe(self) -> str:
        text = f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x tp={self.tp}"
        if self.ep_spans_cp:
            text += f"; ep={self.ep} spans dp_shard x cp (experts whole on each rank)"
        elif self.ep > 1:
            text += f"; ep={self.ep} inside dp_shard (experts FSDP over dp_shard/ep={self.expert_fsdp}"
            text += f", replicated over dp_replicate={self.dp_replicate})" if self.dp_replicate > 1 else ")"
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


def _tp_rule(mod_name: str, mod: nn.Module, pname: str, parent: nn.Module | None,
             p: torch.Tensor) -> tuple[str, int | None]:
    """(kind, TP-split dim or None) of parameter ``pname`` of ``mod``."""
    leaf = mod_name.rsplit(".", 1)[-1]
    if mod_name.split(".", 1)[0] == "visual":  # the vision tower: replicated over tp (parallel/visual.py)
        return "vision", None
    if isinstance(mod, nn.Embedding):
        return "embedding", 0
    if isinstance(mod, GroupedExperts):  # w1, w3 [E, F, D]; w2 [E, D, F]: split F; b1, b3 [E, F]; b2 [E, D]
        return "experts", {"w2": 2, "b2": None}.get(pname, 1)
    if isinstance(mod, GQA) and pname == "sinks":  # GPT-OSS: one sink per head, split with the heads
        return "attention", 0
    if isinstance(mod, GatedDeltaNet) and pname in ("A_log", "dt_bias"):  # per value head
        return "attention", 0
    if isinstance(mod, nn.Linear):
        col = 0 if (pname == "weight" or p.dim() == 1) else None
        row = 1 if pname == "weight" else None  # a row-wise layer's bias is replicated
        if mod_name == "output":
            return "head", col
        if isinstance(parent, GQA):
            return "attention", row if leaf == "wo" else col
        if isinstance(parent, GatedDeltaNet):  # in_proj_qkv: whole on every rank (HeadRowsLinear)
            return "attention", row if leaf == "wo" else (None if leaf == "in_proj_qkv" else col)
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


def stage_layout(model: nn.Module, layout: Layout, schedule: str = "1F1B", split: str = "even",
                 seq_len: int | None = None) -> tuple[list[range], list[list[int]]]:
    """(layer range of every pipeline stage, the stage ids each pipeline rank holds) -- the runner's
    split (:func:`split_sizes`, :func:`layer_ranges`) and placement (:func:`stage_ids_for_rank`)."""
    n_stages = layout.pp * (stages_per_rank(schedule) if layout.pp > 1 else 1)
    if layout.pp > 1:
        try:
            sizes = split_sizes(model, n_stages, split, seq_len)
            ranges = layer_ranges(len(model.layers), n_stages, sizes)
        except ValueError as err:
            flag_error("--pp", str(err).removeprefix("pp: "))
        return ranges, [stage_ids_for_rank(schedule, r, layout.pp) for r in range(layout.pp)]
    return layer_ranges(len(model.layers), 1), [[0]]


def place_parameters(model: nn.Module, layout: Layout, schedule: str = "1F1B", split: str = "even",
                     seq_len: int | None = None) -> tuple[list[ParamPlacement], list[range], list[str]]:
    """Every parameter's placement under ``layout`` (shared parameters once, plus the embedding copy
    the last stage keeps for MTP or a tied head), the layer ranges of the pipeline stages, and notes
    about parameters no rule knew. ``ParamPlacement.stage`` is the pipeline *rank*."""
    notes: list[str] = []
    keys = list(model.layers.keys())
    ranges, rank_stages = stage_layout(model, layout, schedule, split, seq_len)
    rank_of_stage = {s: r for r, ids in enumerate(rank_stages) for s in ids}
    stage_of_layer = {keys[i]: rank_of_stage[s] for s, r in enumerate(ranges) for i in r}
    modules = dict(model.named_modules())
    last = last_stage_pp_rank(schedule, layout.pp) if layout.pp > 1 else 0
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
                flag_error("--tp", f"{layout.tp} does not divide dim {tp_dim} (={p.shape[tp_dim]}) of {name}")
            ep, fsdp, fsdp_dim = 1, layout.dp_shard, 0
            if kind == "experts" and layout.ep > 1:
                ep, fsdp = layout.ep, layout.expert_fsdp
                unit = f"{mod_name}"  # experts are their own FSDP unit on the dp_shard/ep mesh
                if p.shape[0] // ep < fsdp:  # fewer local experts than FSDP ranks: shard the hidden dim
                    fsdp_dim = 1
            placed = ParamPlacement(name=name, shape=tuple(p.shape), kind=kind, stage=stage, unit=unit,
                                    tp_dim=tp_dim, tp=tp, ep=ep, fsdp_dim=fsdp_dim, fsdp=fsdp)
            out.append(placed)
            needs_copy = getattr(model, "mtp", None) is not None or model.config.tie_embeddings
            if kind == "embedding" and last != 0 and needs_copy:  # split_into_stages' copy on the last stage
                copy_name = name if getattr(model, "mtp", None) is not None else "output.weight"  # the tied head's
                out.append(dataclasses.replace(placed, name=copy_name, stage=last, kind="embedding_copy"))
    if unknown:
        notes.append(f"TP-replicated (no TP rule): {compress_names(unknown)}")
    return out, ranges, notes


def compress_names(names: Iterable[str], limit: int = 4) -> str:
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


def ffn_is_moe(block: nn.Module) -> bool:
    """Whether ``block``'s feed-forward is a routed-expert MoE."""
    return isinstance(block.feed_forward, MoE)
