"""The config of the Gated DeltaNet hybrid families (``qwen3_next`` and ``qwen3_5``).

One class serves both: a hybrid layer schedule (:class:`HybridTransformerConfig`: Gated DeltaNet
blocks and output-gated full-attention blocks with partial RoPE) and Qwen3-MoE's per-layer
dense/MoE choice (``decoder_sparse_step`` / ``mlp_only_layers``). A dense model has a SwiGLU
``feed_forward``; an MoE model a :class:`MoEConfig` with one gated shared expert. Every norm is a
zero-centred RMSNorm (weight = scale - 1), as in the Hugging Face checkpoints.
"""

from __future__ import annotations

import dataclasses

from lockstep.models.common.gated_attention import GatedAttentionConfig, PartialRopeConfig
from lockstep.models.common.gated_deltanet import GatedDeltaNetConfig
from lockstep.models.common.hybrid import HybridTransformerConfig
from lockstep.models.common.mlp import SwiGLUConfig
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.norm import ZeroCenteredRMSNormConfig
from lockstep.models.qwen3_moe.config import Qwen3MoETransformerConfig


@dataclasses.dataclass(kw_only=True)
class Qwen3NextTransformerConfig(HybridTransformerConfig, Qwen3MoETransformerConfig):
    """Hybrid Gated DeltaNet / full-attention decoder, dense or MoE per layer (see the module docstring)."""

    #: the Hugging Face checkpoint is the text part of a multimodal Qwen3.5 (``text_config``, weights
    #: under ``model.language_model.``); save_hf then writes that layout back (text weights only)
    hf_multimodal: bool = False


def hybrid_config(family: str, flavor: str, *, projection: str, linear_heads: tuple[int, int],
                  linear_head_dims: tuple[int, int], conv_kernel: int = 4, n_experts: int = 0, top_k: int = 0,
                  moe_ffn_dim: int = 0, shared_ffn_dim: int = 0, norm_topk_prob: bool = True,
                  rope_theta: float = 10_000_000.0, partial_rotary_factor: float = 0.25,
                  full_attention_interval: int = 4, norm_eps: float = 1e-6, **sizes) -> Qwen3NextTransformerConfig:
    """A hybrid config: ``linear_heads = (key heads, value heads)``, ``linear_head_dims = (Dk, Dv)``;
    ``n_experts > 0`` makes every layer MoE with one sigmoid-gated shared expert of ``shared_ffn_dim``."""
    feed_forward = SwiGLUConfig()
    if n_experts:
        feed_forward = MoEConfig(n_routed_experts=n_experts, n_activated=top_k, moe_ffn_dim=moe_ffn_dim,
                                 score_func="softmax", norm_topk_prob=norm_topk_prob, n_shared_experts=1,
                                 shared_ffn_dim=shared_ffn_dim, shared_expert_gate=True)
    linear = GatedDeltaNetConfig(n_k_heads=linear_heads[0], n_v_heads=linear_heads[1],
                                 k_head_dim=linear_head_dims[0], v_head_dim=linear_head_dims[1],
                                 conv_kernel=conv_kernel, projection=projection)
    return Qwen3NextTransformerConfig(
        family=family, flavor=flavor, norm_eps=norm_eps,
        rope=PartialRopeConfig(theta=rope_theta, partial_rotary_factor=partial_rotary_factor),
        attention=GatedAttentionConfig(), linear_attention=linear, feed_forward=feed_forward,
        norm=ZeroCenteredRMSNormConfig(), full_attention_interval=full_attention_interval, **sizes)
