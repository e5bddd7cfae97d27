"""Initial weights for a run: an HF directory, a lockstep directory, or a named pretrained model.

``load_pretrained(name_or_path, config=run_config)`` is what a trainer calls instead of
``build_model`` when a run starts from existing weights. The run's config may differ from the
checkpoint's only in what does not change the function computed: flavor name, init_std, the
attention backend (also through overrides) and ``max_seq_len`` (RoPE tables are computed, not
stored). Anything else is a ConfigError naming the field.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.config.base import ConfigError, to_dict
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.transformer import Transformer, TransformerConfig

#: names ``resolve_pretrained`` understands -> function(cache_dir) materialising an HF directory
PRETRAINED: dict[str, Callable[..., Path]] = {}


def _smollm2(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    from lockstep.models.hf.gguf import smollm2_hf_dir

    return smollm2_hf_dir(cache_dir)


PRETRAINED["smollm2"] = _smollm2
PRETRAINED["smollm2-135m-instruct"] = _smollm2

#: TransformerConfig fields a run may change without changing the checkpoint's function
IGNORED_FIELDS = ("flavor", "init_std", "max_seq_len", "overrides")


def resolve_pretrained(name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory of ``name_or_path``: a registered name (downloaded/converted once) or a path."""
    key = str(name_or_path)
    if key in PRETRAINED:
        return PRETRAINED[key](cache_dir)
    path = Path(key).expanduser()
    if not path.is_dir():
        raise ConfigError(f"init_from: {key!r} is neither a directory nor a known pretrained name "
                          f"({sorted(PRETRAINED)})")
    return path


def checkpoint_config(path: str | os.PathLike[str]) -> TransformerConfig:
    """The TransformerConfig stored with a checkpoint directory (HF or lockstep)."""
    from lockstep.models.hf.io import CONFIG_NAME, load_hf_config, load_lockstep_config

    path = Path(path)
    return load_hf_config(path) if (path / CONFIG_NAME).is_file() else load_lockstep_config(path)


def _architecture(config: TransformerConfig) -> dict[str, Any]:
    """The config as a dict, without the fields that do not change what the model computes."""
    def strip(slot: Any) -> Any:
        if isinstance(slot, AttentionConfig):
            slot = dataclasses.replace(slot, backend="sdpa")
        return to_dict(slot)

    out = {k: v for k, v in to_dict(config).items() if k not in IGNORED_FIELDS}
    out["attention"] = strip(config.attention)
    out["slots"] = {path: strip(slot) for path, slot in config.slots().items()}
    return out


def check_same_architecture(checkpoint: TransformerConfig, run: TransformerConfig, where: str) -> None:
    """ConfigError naming every field where ``run`` computes something other than ``checkpoint``."""
    a, b = _architecture(checkpoint), _architecture(run)
    diffs = []

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for key in sorted(set(x) | set(y)):
                walk(x.get(key), y.get(key), f"{path}.{key}" if path else key)
        elif x != y:
            diffs.append(f"model.{path}: checkpoint has {x!r}, run config has {y!r}")

    walk(a, b, "")
    if diffs:
        raise ConfigError(f"{where}: the run's model config does not match the checkpoint: "
                          + "; ".join(d.replace("model.slots.", "model slot ") for d in diffs[:12])
                          + (f"; ... ({len(diffs) - 12} more)" if len(diffs) > 12 else ""))


def load_pretrained(
    name_or_path: str | os.PathLike[str],
    config: TransformerConfig | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = torch.float32,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Transformer:
    """A Transformer holding the weights of ``name_or_path`` (HF dir, lockstep/run dir, or a
    name in ``PRETRAINED``), built from ``config`` when given (checked against the checkpoint's)."""
    from lockstep.models.hf.io import CONFIG_NAME, load_hf, load_lockstep_dir

    path = resolve_pretrained(name_or_path, cache_dir)
    if (path / CONFIG_NAME).is_file():
        return load_hf(path, device=device, dtype=dtype, config=config)
    if config is not None:
        check_same_architecture(checkpoint_config(path), config, str(path))
    model = load_lockstep_dir(path, device=device, dtype=dtype)
    if config is None or config == model.config:
        return model
    from lockstep.models.hf.io import _materialize, _meta_model

    state = model.state_dict()
    return _materialize(_meta_model(config), state, device)
