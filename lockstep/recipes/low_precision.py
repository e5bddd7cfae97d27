"""Low-precision training recipes: the update's headline workload, DeepSeek-V3 + MTP1 in MXFP8.

``dsv3-mtp-mxfp8`` is the DeepSeek-V3 architecture (MLA, a dense first layer, routed + shared experts
with aux-loss-free balancing and the sequence balance loss, one MTP head) at a small shape whose every
linear and expert GEMM is a multiple of MXFP8's 32-element block, so all of them convert except the
output head and the routers (kept in high precision by default). On CPU the MXFP8 GEMMs are emulated
(torchao for linears, lockstep.convert for experts): it trains, slowly, and the run's manifest says so.
"""

from __future__ import annotations

from lockstep.convert.config import LowPrecisionConfig
from lockstep.models.registry import model_config
from lockstep.recipes.pretrain import debug
from lockstep.recipes.registry import recipe
from lockstep.train.config import TrainerConfig


@recipe("dsv3-mtp-mxfp8", "small deepseek_v3 + MTP1 with MXFP8 experts and linears (emulated on CPU): "
        "the update's headline workload, a few minutes on 2 cores")
def dsv3_mtp_mxfp8() -> TrainerConfig:
    cfg = debug()
    model = model_config("deepseek_v3", "debug")
    model.dim, model.ffn_dim, model.n_heads, model.n_kv_heads, model.head_dim = 128, 256, 4, 4, 32
    mla = model.attention
    # every projection's dims multiples of 32 (head_dim is the rope width): wkv_a is 128 -> 64 + 32,
    # wkv_b 64 -> n_heads * (32 + 32), wq_b 64 -> n_heads * (32 + 32)
    mla.q_lora_rank, mla.kv_lora_rank = 64, 64
    mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim = 32, 32, 32
    moe = model.feed_forward
    moe.moe_ffn_dim = 64
    moe.bias_update_speed = 0.01  # aux-loss-free balancing
    moe.seq_aux_loss_coef = 0.01
    cfg.model = model
    cfg.steps = 30
    cfg.training.dtype = "bfloat16"
    cfg.low_precision = LowPrecisionConfig(format="mxfp8")
    return cfg
