"""FlexShard buckets from config: spec strings, the ``muon`` preset, and matching parameters to buckets.

Spec string (``parallel.flex_buckets`` entries, CLI friendly)::

    GLOB[|GLOB...]=PLACEMENT[+fp8][@MESH_DIM]
    PLACEMENT: shard | shard(D) | owned | block_shard(D,B)

e.g. ``"layers.*.attention.w[qkv].weight=block_shard(0,16)"``, ``"layers.*.feed_forward.*=owned"``,
``"layers.*.feed_forward.w[13].weight=block_shard(0,128)+fp8"``. Globs match clean parameter FQNs
(:func:`lockstep.checkpoint.train_state.param_fqns`) by the one glob rule of
:func:`lockstep.config.overrides.match_module_globs`. Every parameter must be matched by exactly one
bucket. MESH_DIM: ``dp_shard`` (default; under HSDP gradients are also averaged over ``dp_replicate``)
or ``dp`` (every data-parallel rank).
"""

from __future__ import annotations

import re

from torch import nn

from lockstep.config.base import ConfigError
from lockstep.config.overrides import match_module_globs
from lockstep.parallel.flex.layout import BlockShard, Bucket, Owned, Shard

MESH_DIMS = ("dp_shard", "dp")
PRESETS = ("", "muon")
_PLACEMENT = re.compile(r"^(?:(?P<shard>shard)(?:\((?P<sdim>\d+)\))?|(?P<owned>owned)"
                        r"|(?P<block>block_shard)\((?P<bdim>\d+)\s*,\s*(?P<bsize>\d+)\))"
                        r"(?P<fp8>\+fp8)?(?:@(?P<mesh>\w+))?$")


def parse_bucket(spec: str, field: str) -> Bucket:
    """One spec string -> a :class:`Bucket` named ``field`` (a ConfigError naming ``field`` if bad)."""
    if not isinstance(spec, str) or "=" not in spec:
        raise ConfigError(f"{field}: expected 'GLOB[|GLOB...]=PLACEMENT' (placement shard(D), owned or "
                          f"block_shard(D,B), optionally +fp8 and @MESH_DIM), got {spec!r}")
    globs, placement = spec.rsplit("=", 1)
    patterns = [g.strip() for g in globs.split("|")]
    if not all(patterns):
        raise ConfigError(f"{field}: empty glob in {spec!r}")
    m = _PLACEMENT.match(placement.replace(" ", ""))
    if m is None:
        raise ConfigError(f"{field}: unknown placement {placement!r} in {spec!r}; use shard(D), owned or "
                          f"block_shard(D,B), optionally followed by +fp8 and @MESH_DIM")
    if m["shard"]:
        place = Shard(int(m["sdim"] or 0))
    elif m["owned"]:
        place = Owned()
    else:
        if int(m["bsize"]) < 1:
            raise ConfigError(f"{field}: block_shard block must be >= 1, got {m['bsize']} in {spec!r}")
        place = BlockShard(int(m["bdim"]), int(m["bsize"]))
    bucket = Bucket(patterns, place, mesh_dim=m["mesh"] or "dp_shard", fp8=bool(m["fp8"]), name=field)
    check_bucket(bucket, field)
    return bucket


def check_bucket(bucket: Bucket, field: str) -> None:
    if not isinstance(bucket.placement, (Shard, Owned, BlockShard)):
        raise ConfigError(f"{field}: unknown placement {bucket.placement!r}")
    if bucket.mesh_dim not in MESH_DIMS:
        raise ConfigError(f"{field}: mesh dim must be one of {list(MESH_DIMS)}, got {bucket.mesh_dim!r}")
    if bucket.fp8 and not isinstance(bucket.placement, BlockShard):
        raise ConfigError(f"{field}: fp8 gathers need block_shard(D,B) (whole quantisation tiles per rank), "
                          f"got {bucket.describe()}")


def parse_buckets(specs: list[str], field: str = "parallel.flex_buckets") -> list[Bucket]:
    return [parse_bucket(spec, f"{field}[{i}]") for i, spec in enumerate(specs)]


def default_buckets() -> list[Bucket]:
    """Empty ``flex_buckets``: one bucket of everything with shard(0) (FSDP-like)."""
    return [Bucket(["*"], Shard(0), name="all=shard(0)")]


def muon_preset(model: nn.Module) -> list[Bucket]:
    """Hidden matrices (Muon's, :func:`lockstep.train.muon.split_parameters`) owned -- except attention
    q/k/v weights, block_shard(0, head_dim) so each rank holds whole heads -- everything else shard(0)."""
    from lockstep.train.muon import split_parameters

    muon, rest = split_parameters(model)
    cfg = getattr(model, "config", None)
    head_dim = getattr(cfg, "head_dim", 0) or (cfg.dim // cfg.n_heads if cfg is not None else 0)
    qkv = [f for f in muon if re.fullmatch(r".*\.attention\.w[qkv]\.weight", f)]
    owned = [f for f in muon if f not in set(qkv)]
    frozen = [fqn for fqn in param_names(model) if fqn not in set(muon) | set(rest)]
    buckets = []
    if qkv and head_dim:
        buckets.append(Bucket(qkv, BlockShard(0, head_dim), name="muon:qkv=block_shard(0,head_dim)"))
    else:
        owned += qkv
    if owned:
        buckets.append(Bucket(owned, Owned(), name="muon:hidden=owned"))
    if rest + frozen:
        buckets.append(Bucket(rest + frozen, Shard(0), name="muon:rest=shard(0)"))
    return buckets


def param_names(model: nn.Module) -> list[str]:
    """Clean FQNs of ``model``'s distinct parameters (a tied pair once), in registration order."""
    from lockstep.checkpoint.train_state import param_fqns

    return list(param_fqns(model).values())


def match_buckets(fqns: list[str], buckets: list[Bucket], field: str = "parallel.flex_buckets") -> dict[str, int]:
    """FQN -> index of its bucket. ConfigErrors: a glob matching nothing (naming ``field[i]``), a
    parameter matched by no bucket or by two (naming it and the buckets)."""
    owner: dict[str, list[int]] = {f: [] for f in fqns}
    for i, bucket in enumerate(buckets):
        name = bucket.name or f"{field}[{i}]"
        check_bucket(bucket, name)
        for matched in match_module_globs(fqns, bucket.patterns, name).values():
            for fqn in matched:
                if i not in owner[fqn]:
                    owner[fqn].append(i)
    for fqn, found in owner.items():
        if not found:
            raise ConfigError(f"{field}: parameter {fqn!r} is matched by no bucket "
                              f"({[b.name or b.patterns for b in buckets]}); every parameter needs exactly one")
        if len(found) > 1:
            names = [f"{buckets[i].name or f'{field}[{i}]'} {buckets[i].patterns}" for i in found]
            raise ConfigError(f"{field}: parameter {fqn!r} is matched by {len(found)} buckets: {' and '.join(names)}; "
                              f"every parameter needs exactly one")
    return {fqn: found[0] for fqn, found in owner.items()}


def buckets_from_config(config, model: nn.Module) -> list[Bucket]:
    """The buckets of a ParallelConfig (``flex_preset`` or ``flex_buckets``; neither: shard(0) all)."""
    if config.flex_preset == "muon":
        return muon_preset(model)
    if config.flex_buckets:
        return parse_buckets(config.flex_buckets)
    return default_buckets()
