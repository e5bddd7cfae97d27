"""The layout of a ``lockstep plan`` dry run and where every parameter lives under it.

    world = pp x dp_replicate x dp_shard x tp        (ep is carved out of dp_shard)

* **PP** cuts ``layers`` into ``pp`` contiguous stages by count (earlier stages take the remainder,
  as :func:`lockstep.parallel.pipeline.layer_ranges`); the first stage also holds the embedding,
  the last the final norm, the head and any MTP modules.
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
from lockstep.models.common.mla import MultiHeadLatentAttention as MLA
from lockstep.models.common.mlp import SwiGLU
from lockstep.models.common.moe import GroupedExperts, MoE
from lockstep.parallel.pipeline import layer_ranges  # the split the runner uses
from lockstep.config.base import ConfigError

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
SCHEDULES = ("1F1B", "GPipe")
AC_MODES = ("none", "selective", "full")
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
            flag_error("--world", f"must be >= 1, got {self.world}")
        for flag, value in (("--pp", self.pp), ("--dp-replicate", self.dp_replicate), ("--tp", self.tp),
                            ("--ep", self.ep)):
            if value < 1:
                flag_error(flag, f"must be >= 1, got {value}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            flag_error("--dp-shard", f"must be >= 1 or -1 (auto), got {self.dp_shard}")
        others = self.pp * self.dp_replicate * self.tp
        if self.dp_shard == -1:
            if self.world % others:
                flag_error("--world", f"{self.world} is not divisible by pp={self.pp} x dp_replicate="
                           f"{self.dp_replicate} x tp={self.tp} = {others}, so --dp-shard=-1 (auto) has no whole value")
            dp_shard = self.world // others
        else:
            dp_shard = self.dp_shard
        product = others * dp_shard
        if product != self.world:
            flag_error("--world", f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={dp_shard} x "
                       f"tp={self.tp} = {product}, but the world size is {self.world}")
        if dp_shard % self.ep:
            flag_error("--ep", f"{self.ep} does not divide --dp-shard={dp_shard} (expert-parallel ranks are taken "
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
                flag_error("--tp", f"{layout.tp} does not divide dim {tp_dim} (={p.shape[tp_dim]}) of {name}")
            ep, fsdp, fsdp_dim = 1, layout.dp_shard, 0
            if kind == "experts" and layout.ep > 1:
                ep, fsdp = layout.ep, layout.expert_fsdp
                unit = f"{mod_name}"  # experts are their own FSDP unit on the dp_shard/ep mesh
                if p.shape[0] // ep < fsdp:  # fewer local experts than FSDP ranks: shard the hidden dim
                    fsdp_dim = 1
            out.append(ParamPlacement(name=name, shape=tuple(p.shape), kind=kind, stage=stage, unit=unit,
                                      tp_dim=tp_dim, tp=tp, ep=ep, fsdp_dim=fsdp_dim, fsdp=fsdp))
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
