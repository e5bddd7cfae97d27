"""YaRN RoPE fields of an HF ``config.json`` <-> :class:`YarnRopeConfig` (DeepSeek-V3, GPT-OSS).

Reads transformers 5 ``rope_parameters`` or the legacy ``rope_scaling`` + top-level ``rope_theta``
(what released checkpoints hold); writes ``rope_parameters``. Defaults follow transformers'
``_compute_yarn_parameters`` (beta_fast 32, beta_slow 1, truncate true, factor from
``max_position_embeddings / original_max_position_embeddings`` when absent).
"""

from __future__ import annotations

from typing import Any

from lockstep.config.base import ConfigError
from lockstep.models.common.rope_yarn import YarnRopeConfig


def yarn_rope_from_hf(hf: dict[str, Any], family: str, default: dict[str, Any] | None = None) -> YarnRopeConfig:
    """The rope config of ``hf`` (``default``: the parameters transformers assumes when the file has none)."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or default or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    if rope_type == "default":
        return YarnRopeConfig(theta=theta, scaling="none")
    if rope_type != "yarn":
        raise ConfigError(f"config.json rope type {rope_type!r} is not supported for {family} (default, yarn)")
    original = int(params.get("original_max_position_embeddings") or hf["max_position_embeddings"])
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    return YarnRopeConfig(
        theta=theta, scaling="yarn", factor=float(factor), original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=float(params.get("attention_factor") or 0.0), truncate=bool(params.get("truncate", True)),
    )


def yarn_rope_to_hf(rope: Any, family: str) -> dict[str, Any]:
    """``rope_parameters`` of a plain (``scaling="none"``) or YaRN rope config."""
    scaling = getattr(rope, "scaling", "none")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": rope.theta}
    if scaling != "yarn":
        raise ConfigError(f"model.rope.scaling: {scaling!r} has no {family} HF equivalent (none, yarn)")
    out: dict[str, Any] = {"rope_type": "yarn", "rope_theta": rope.theta, "factor": rope.factor,
                           "original_max_position_embeddings": rope.original_max_position_embeddings,
                           "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow}
    for name in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(rope, name):
            out[name] = getattr(rope, name)
    if not rope.truncate:
        out["truncate"] = False
    return out
