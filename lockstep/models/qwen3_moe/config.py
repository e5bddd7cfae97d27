"""The Qwen3-MoE model config: a TransformerConfig with per-layer dense/MoE choice (HF semantics)."""

from __future__ import annotations

import dataclasses

from lockstep.config.base import Config, require
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.mlp import FeedForwardConfig, SwiGLUConfig
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.rope import RopeConfig
from lockstep.models.common.transformer import TransformerConfig


@dataclasses.dataclass(kw_only=True)
class Qwen3MoETransformerConfig(TransformerConfig):
    """A TransformerConfig whose feed-forward is MoE except on the layers chosen to stay dense."""

    #: layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (as HF)
    decoder_sparse_step: int = 1
    #: layer indices that use the dense feed-forward (ffn_dim) instead of MoE
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)
    #: feed-forward config of the dense layers
    dense_feed_forward: FeedForwardConfig = dataclasses.field(default_factory=SwiGLUConfig)

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def validate(self, path: str = "model") -> None:
        require(self.decoder_sparse_step >= 1, f"{path}.decoder_sparse_step",
                f"must be >= 1, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        require(not bad, f"{path}.mlp_only_layers", f"indices {bad} are outside [0, n_layers={self.n_layers})")
        super().validate(path)

    def default_slots(self) -> dict[str, Config]:
        slots = super().default_slots()
        for i in range(self.n_layers):
            if not self.is_moe_layer(i):
                slots[f"layers.{i}.feed_forward"] = self.dense_feed_forward
        return slots


def qwen3_moe_config(flavor: str, *, n_experts: int, top_k: int, moe_ffn_dim: int,
                     norm_topk_prob: bool = True, **sizes) -> Qwen3MoETransformerConfig:
    """A Qwen3-MoE config: Qwen3 attention and norms, softmax top-k MoE feed-forward."""
    moe = MoEConfig(n_routed_experts=n_experts, n_activated=top_k, moe_ffn_dim=moe_ffn_dim,
                    score_func="softmax", norm_topk_prob=norm_topk_prob)
    return Qwen3MoETransformerConfig(family="qwen3_moe", flavor=flavor, norm_eps=1e-6,
                                     rope=RopeConfig(theta=1000000.0),
                                     attention=AttentionConfig(qk_norm=True), feed_forward=moe, **sizes)
