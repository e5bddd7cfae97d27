"""The Qwen3-VL model config: the Qwen3 / Qwen3-MoE text decoder with interleaved mRoPE, plus a vision tower.

Dense and MoE share one class (Qwen3-MoE's per-layer choice: a dense model has a SwiGLU
``feed_forward``, an MoE model a softmax top-k :class:`MoEConfig` with normalised weights and no shared
expert, as transformers' ``Qwen3VLMoeTextSparseMoeBlock``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.mlp import FeedForwardConfig, SwiGLUConfig
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.mrope import MRopeConfig
from lockstep.models.common.rope import RopeConfig
from lockstep.models.common.vision import VisionConfig, check_vision_language
from lockstep.models.qwen3_moe.config import Qwen3MoETransformerConfig

if TYPE_CHECKING:
    from lockstep.models.qwen3_vl.model import Qwen3VLModel


@dataclasses.dataclass(kw_only=True)
class Qwen3VLConfig(Qwen3MoETransformerConfig):
    """Qwen3-VL: text decoder sizes (the TransformerConfig fields), ``vision`` tower and special tokens."""

    family: str = "qwen3_vl"
    rope: RopeConfig = dataclasses.field(default_factory=lambda: MRopeConfig(theta=5_000_000.0))
    #: the vision tower (its output width is ``dim``)
    vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
    #: placeholder token of one merged image patch
    image_token_id: int = 151655
    #: placeholder token of one merged video patch (videos are not implemented here)
    video_token_id: int = 151656
    #: token before an image's placeholders
    vision_start_token_id: int = 151652
    #: token after an image's placeholders
    vision_end_token_id: int = 151653

    def validate(self, path: str = "model") -> None:
        check_vision_language(self, path)
        super().validate(path)

    def build(self) -> "Qwen3VLModel":
        from lockstep.models.qwen3_vl.model import Qwen3VLModel

        return Qwen3VLModel(self)


def qwen3_vl_config(flavor: str, *, vision: VisionConfig, mrope_section: list[int], rope_theta: float = 5_000_000.0,
                    n_experts: int = 0, top_k: int = 0, moe_ffn_dim: int = 0, **sizes) -> Qwen3VLConfig:
    """A Qwen3-VL config; ``n_experts > 0`` makes every layer MoE (Qwen3-VL-MoE)."""
    feed_forward: FeedForwardConfig = SwiGLUConfig()
    if n_experts:
        feed_forward = MoEConfig(n_routed_experts=n_experts, n_activated=top_k, moe_ffn_dim=moe_ffn_dim,
                                 score_func="softmax", norm_topk_prob=True)
    sizes.setdefault("norm_eps", 1e-6)
    return Qwen3VLConfig(flavor=flavor, rope=MRopeConfig(theta=rope_theta, mrope_section=mrope_section),
                         attention=AttentionConfig(qk_norm=True), feed_forward=feed_forward, vision=vision, **sizes)
