"""YaRN rotary frequency scaling (DeepSeek-V3, Kimi-K2), matching transformers' ``_compute_yarn_parameters``.

``YarnRopeConfig`` is a :class:`RopeConfig` that adds ``scaling="yarn"`` (plain and llama3 scaling still
work through the base class). YaRN blends, per frequency, the original inverse frequency
(extrapolation, high frequencies) with the frequency divided by ``factor`` (interpolation, low
frequencies) over a linear ramp between the dimensions where a wavelength makes ``beta_fast`` and
``beta_slow`` rotations within ``original_max_position_embeddings``. The cos/sin tables are multiplied by
the *attention factor* (``mscale``); DeepSeek additionally scales the attention softmax by
``get_mscale(factor, mscale_all_dim) ** 2`` (:meth:`YarnRopeConfig.softmax_mscale`), which MLA applies.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lockstep.config.base import Config, require, require_choice, require_positive
from lockstep.models.common.rope import RopeConfig, RotaryEmbedding, llama3_scale


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(kw_only=True)
class YarnRopeConfig(RopeConfig):
    """Rotary embedding frequencies with optional YaRN context extension (HF ``rope_type="yarn"``)."""

    #: frequency scaling: "none", "llama3" or "yarn"
    scaling: str = "yarn"
    #: llama3 / yarn scaling: factor by which the context was extended
    factor: float = 40.0
    #: llama3 / yarn scaling: the pre-extension context length
    original_max_position_embeddings: int = 4096
    #: yarn: rotations within the original context above which dimensions are kept (extrapolated)
    beta_fast: float = 32.0
    #: yarn: rotations within the original context below which dimensions are interpolated
    beta_slow: float = 1.0
    #: yarn: numerator mscale of the cos/sin attention factor (0 = unset, as HF's None)
    mscale: float = 0.0
    #: yarn: denominator mscale of the attention factor and the softmax mscale (0 = unset)
    mscale_all_dim: float = 0.0
    #: yarn: explicit cos/sin attention factor; 0 derives it from factor / mscale / mscale_all_dim
    attention_factor: float = 0.0
    #: yarn: round the correction range outward to whole dimensions (HF ``truncate``)
    truncate: bool = True

    def validate(self, path: str = "") -> None:
        require_positive(self.theta, f"{path}.theta")
        require_choice(self.scaling, ["none", "llama3", "yarn"], f"{path}.scaling")
        if self.scaling == "llama3":
            RopeConfig.validate(self, path)
        if self.scaling == "yarn":
            require_positive(self.factor, f"{path}.factor")
            require_positive(self.original_max_position_embeddings, f"{path}.original_max_position_embeddings")
            require_positive(self.beta_fast, f"{path}.beta_fast")
            require_positive(self.beta_slow, f"{path}.beta_slow")
            for name in ("mscale", "mscale_all_dim", "attention_factor"):
                value = getattr(self, name)
                require(value >= 0, f"{path}.{name}", f"must be >= 0 (0 = unset), got {value}")

    def inverse_frequencies(self, head_dim: int) -> torch.Tensor:
        if self.scaling == "yarn":
            return _yarn_inverse_frequencies(self, head_dim)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.scaling == "llama3":
            inv_freq = llama3_scale(inv_freq, self)
        return inv_freq

    def cos_sin_factor(self) -> float:
        """Multiplier of the cos/sin tables (HF ``attention_scaling``); 1 unless YaRN."""
        if self.scaling != "yarn":
            return 1.0
        if self.attention_factor:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim))
        return yarn_get_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """Multiplier of the attention softmax scale DeepSeek applies under YaRN (mscale_all_dim squared)."""
        if self.scaling != "yarn" or not self.mscale_all_dim:
            return 1.0
        m = yarn_get_mscale(self.factor, self.mscale_all_dim)
        return m * m

    def build(self, *, head_dim: int, max_seq_len: int) -> "YarnRotaryEmbedding":
        return YarnRotaryEmbedding(self, head_dim, max_seq_len)


def softmax_mscale_of(rope: Config) -> float:
    """The softmax-scale multiplier a rope config implies (1 for configs without YaRN)."""
    fn = getattr(rope, "softmax_mscale", None)
    return float(fn()) if callable(fn) else 1.0


def _yarn_inverse_frequencies(cfg: YarnRopeConfig, dim: int) -> torch.Tensor:
    """Op for op the computation of transformers' ``_compute_yarn_parameters`` (so tables match bitwise)."""
    base, factor = cfg.theta, cfg.factor
    original = cfg.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor


class YarnRotaryEmbedding(RotaryEmbedding):
    """Rotary tables whose cos/sin carry the YaRN attention factor (as HF multiplies them)."""

    config: YarnRopeConfig

    def reset_parameters(self) -> None:
        super().reset_parameters()
        factor = self.config.cos_sin_factor()
        if factor != 1.0:
            self.cos.mul_(factor)
            self.sin.mul_(factor)
