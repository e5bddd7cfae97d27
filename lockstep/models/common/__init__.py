"""Building blocks shared by every model family; their configs are registered as override kinds."""

from lockstep.config.components import register_component
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.gated_attention import GatedAttentionConfig
from lockstep.models.common.gated_deltanet import GatedDeltaNetConfig
from lockstep.models.common.mla import MLAConfig
from lockstep.models.common.mlp import SwiGLUConfig
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.norm import RMSNormConfig, ZeroCenteredRMSNormConfig

register_component("attention", AttentionConfig)
register_component("gated_attention", GatedAttentionConfig)
register_component("gated_deltanet", GatedDeltaNetConfig)
register_component("mla", MLAConfig)
register_component("moe", MoEConfig)
register_component("rmsnorm", RMSNormConfig)
register_component("zero_centered_rmsnorm", ZeroCenteredRMSNormConfig)
register_component("swiglu", SwiGLUConfig)
