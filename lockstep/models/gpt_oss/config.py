"""The GPT-OSS model config: a TransformerConfig whose layers alternate sliding-window and full attention.

``layer_types`` names each layer's attention as transformers does (``"sliding_attention"`` or
``"full_attention"``); the sliding layers get ``attention.sliding_window = sliding_window`` in their
slot. Attention has q/k/v/o biases and learned sinks; every feed-forward is a mixture of experts
(top-k logits, softmax over those k, clamped SwiGLU experts with biases); RoPE is YaRN.
"""

from __future__ import annotations

import dataclasses

from lockstep.config.base import Config, require
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.rope_yarn import YarnRopeConfig
from lockstep.models.common.transformer import TransformerConfig

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)


def alternating_layer_types(n_layers: int) -> list[str]:
    """GPT-OSS's default schedule (transformers' ``GptOssConfig``): even layers sliding, odd layers full."""
    return [SLIDING if i % 2 == 0 else FULL for i in range(n_layers)]


@dataclasses.dataclass(kw_only=True)
class GptOssTransformerConfig(TransformerConfig):
    """A TransformerConfig with per-layer sliding-window / full attention (HF ``layer_types``)."""

    #: each layer's attention: "sliding_attention" or "full_attention"; empty: alternating, sliding first
    layer_types: list[str] = dataclasses.field(default_factory=list)
    #: keys a sliding layer's query sees (itself included)
    sliding_window: int = 128

    def resolved_layer_types(self) -> list[str]:
        return list(self.layer_types) or alternating_layer_types(self.n_layers)

    def validate(self, path: str = "model") -> None:
        types = self.resolved_layer_types()
        require(len(types) == self.n_layers, f"{path}.layer_types",
                f"has {len(types)} entries for n_layers={self.n_layers}")
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        require(not bad, f"{path}.layer_types", f"unknown type(s) {bad}; choose from {list(LAYER_TYPES)}")
        if SLIDING in types:
            require(self.sliding_window > 0, f"{path}.sliding_window",
                    f"must be > 0 when a layer is {SLIDING!r}, got {self.sliding_window}")
        super().validate(path)

    def default_slots(self) -> dict[str, Config]:
        slots = super().default_slots()
        for i, kind in enumerate(self.resolved_layer_types()):
            if kind == SLIDING:
                slots[f"layers.{i}.attention"] = dataclasses.replace(self.attention, sliding_window=self.sliding_window)
        return slots


def gpt_oss_moe(n_experts: int, top_k: int, moe_ffn_dim: int, swiglu_alpha: float = 1.702,
                swiglu_limit: float = 7.0) -> MoEConfig:
    """GPT-OSS's feed-forward: router with bias, softmax over the top-k logits, clamped SwiGLU experts with biases."""
    return MoEConfig(n_routed_experts=n_experts, n_activated=top_k, moe_ffn_dim=moe_ffn_dim,
                     score_func="topk_softmax", router_bias=True, expert_bias=True, activation="clamped_swiglu",
                     swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)


def gpt_oss_attention(bias: bool = True) -> AttentionConfig:
    """GPT-OSS's attention: q/k/v/o biases and learned sinks (the window is set per layer by the schedule)."""
    return AttentionConfig(qkv_bias=bias, o_bias=bias, sinks=True)


def gpt_oss_rope(theta: float = 150000.0, factor: float = 32.0, original: int = 4096) -> YarnRopeConfig:
    """The released models' YaRN RoPE (transformers' ``GptOssConfig`` default: truncate false)."""
    return YarnRopeConfig(theta=theta, scaling="yarn", factor=factor, original_max_position_embeddings=original,
                          beta_fast=32.0, beta_slow=1.0, truncate=False)


def gpt_oss_config(flavor: str, *, n_experts: int, top_k: int, sliding_window: int, **sizes) -> GptOssTransformerConfig:
    """A GPT-OSS config; ``sizes`` are TransformerConfig fields (``ffn_dim`` is each expert's hidden size)."""
    return GptOssTransformerConfig(
        family="gpt_oss", flavor=flavor, norm_eps=1e-5, rope=gpt_oss_rope(), attention=gpt_oss_attention(),
        feed_forward=gpt_oss_moe(n_experts, top_k, sizes["ffn_dim"]), sliding_window=sliding_window, **sizes)
