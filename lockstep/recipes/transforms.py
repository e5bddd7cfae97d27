"""Model-config transforms: named ``TrainerConfig -> TrainerConfig`` functions, applied in order.

``--transform NAME`` or ``--transform NAME=ARG`` on the command line; they compose (each sees the
previous one's result) and are recorded in the config's ``transforms`` list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lockstep.config.base import ConfigError
from lockstep.config.overrides import ComponentOverride
from lockstep.models.common.attention import AttentionConfig
from lockstep.train.config import TrainerConfig

Transform = Callable[[TrainerConfig, str | None], TrainerConfig]
_TRANSFORMS: dict[str, tuple[Transform, str]] = {}


def transform(name: str, doc: str) -> Callable[[Transform], Transform]:
    def decorator(fn: Transform) -> Transform:
        _TRANSFORMS[name] = (fn, doc)
        return fn

    return decorator


def transform_names() -> dict[str, str]:
    return {name: doc for name, (_, doc) in sorted(_TRANSFORMS.items())}


def _int_arg(name: str, arg: str | None) -> int:
    try:
        value = int(arg) if arg is not None else None
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise ConfigError(f"--transform {name}=N: N must be a positive integer, got {arg!r}")
    return value


def apply_transform(config: TrainerConfig, spec: str) -> TrainerConfig:
    """Apply the transform named by ``spec`` ("name" or "name=arg")."""
    name, _, arg = spec.partition("=")
    if name not in _TRANSFORMS:
        raise ConfigError(f"--transform: unknown transform {name!r}; choose from {sorted(_TRANSFORMS)}")
    fn, _ = _TRANSFORMS[name]
    out = fn(config, arg or None)
    return dataclasses.replace(out, transforms=[*config.transforms, spec])


@transform("bf16", "compute in bfloat16 (autocast; fp32 weights and optimizer)")
def _bf16(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, dtype="bfloat16"))


@transform("fp32", "compute in float32")
def _fp32(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, dtype="float32"))


@transform("seq_len", "seq_len=N: train on N-token sequences (grows model.max_seq_len if needed)")
def _seq_len(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    n = _int_arg("seq_len", arg)
    model = dataclasses.replace(cfg.model, max_seq_len=max(cfg.model.max_seq_len, n))
    return dataclasses.replace(cfg, model=model, training=dataclasses.replace(cfg.training, seq_len=n))


@transform("flavor", "flavor=NAME: swap the model for another flavor of the same family (keeps the vocab)")
def _flavor(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    from lockstep.models.registry import model_config

    if not arg:
        raise ConfigError("--transform flavor=NAME: NAME is missing")
    model = model_config(cfg.model.family, arg)
    model = dataclasses.replace(model, vocab_size=cfg.model.vocab_size,
                                max_seq_len=max(model.max_seq_len, cfg.training.seq_len))
    return dataclasses.replace(cfg, model=model)


@transform("layers", "layers=N: change the number of transformer blocks")
def _layers(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=_int_arg("layers", arg)))


@transform("width", "width=N: scale dim and ffn_dim by N/dim, keeping head_dim and head counts' ratios")
def _width(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    dim = _int_arg("width", arg)
    m = cfg.model
    ffn = max(int(round(m.ffn_dim * dim / m.dim)), 1)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, dim=dim, ffn_dim=ffn))


def _with_indexer(cfg: TrainerConfig, name: str, **changes) -> TrainerConfig:
    """The model with its (model-wide) sparse indexer's fields changed (DeepSeek-V3.2)."""
    att = cfg.model.attention
    if getattr(att, "indexer", None) is None:
        raise ConfigError(f"--transform {name}: model.attention has no sparse indexer (a deepseek_v32 model has one)")
    att = dataclasses.replace(att, indexer=dataclasses.replace(att.indexer, **changes))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=att))


@transform("indexer_loss", "indexer_loss=W: weight of the sparse indexer's KL loss (deepseek_v32; 0 = off)")
def _indexer_loss(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    try:
        weight = float(arg) if arg is not None else -1.0
    except ValueError:
        weight = -1.0
    if weight < 0:
        raise ConfigError(f"--transform indexer_loss=W: W must be a number >= 0, got {arg!r}")
    return _with_indexer(cfg, "indexer_loss", loss_weight=weight)


@transform("indexer_warmup", "deepseek_v32 dense warm-up: dense attention, the indexer learns it (KL weight 1 if off)")
def _indexer_warmup(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    weight = getattr(cfg.model.attention, "indexer", None) and cfg.model.attention.indexer.loss_weight
    return _with_indexer(cfg, "indexer_warmup", stage="dense", loss_weight=weight or 1.0)


@transform("reference_attention", "use the plain reference attention kernel in every layer")
def _reference_attention(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    override = ComponentOverride(
        pattern="layers.*.attention",
        config=dataclasses.replace(cfg.model.attention, backend="reference"),
    )
    assert isinstance(cfg.model.attention, AttentionConfig)
    model = dataclasses.replace(cfg.model, overrides=[*cfg.model.overrides, override])
    return dataclasses.replace(cfg, model=model)


@transform("optimizer", "optimizer=muon|adamw: Muon on hidden matrices (AdamW on the rest), or plain AdamW; "
                        "lr, betas, eps and weight_decay are kept")
def _optimizer(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    from lockstep.train.optim import OptimizerConfig

    if arg not in ("muon", "adamw"):
        raise ConfigError(f"--transform optimizer=NAME: NAME must be 'muon' or 'adamw', got {arg!r}")
    opt = cfg.optimizer
    if arg == "adamw":  # Muon's own fields back to their defaults, so the config reads as plain AdamW
        base = OptimizerConfig()
        opt = dataclasses.replace(opt, momentum=base.momentum, nesterov=base.nesterov, ns_steps=base.ns_steps,
                                  ns_dtype=base.ns_dtype, adamw_params=[], muon_per_head=[])
    return dataclasses.replace(cfg, optimizer=dataclasses.replace(opt, name=arg))


@transform("fp8", "fp8[=rowwise|tensorwise]: FP8 training GEMMs (torchao Float8; emulated on CPU) for aligned "
                  "linears and MoE experts, head and routers kept; rowwise by default")
def _fp8(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    if arg not in (None, "rowwise", "tensorwise"):
        raise ConfigError(f"--transform fp8=SCALING: SCALING must be 'rowwise' or 'tensorwise', got {arg!r}")
    fmt = f"fp8_{arg or 'rowwise'}"
    return dataclasses.replace(cfg, low_precision=dataclasses.replace(cfg.low_precision, format=fmt))


@transform("mxfp8", "MXFP8 training GEMMs (torchao MX, 32-element blocks, e8m0 scales; emulated on CPU) for "
                    "aligned linears and MoE experts, head and routers kept")
def _mxfp8(cfg: TrainerConfig, arg: str | None) -> TrainerConfig:
    return dataclasses.replace(cfg, low_precision=dataclasses.replace(cfg.low_precision, format="mxfp8"))
