"""DeepSeek-V3 family (also Kimi-K2): MLA attention, dense first layers then sigmoid-routed MoE with
group-limited routing and shared experts, YaRN rope, optional multi-token prediction (MTP).

See :mod:`lockstep.models.deepseek_v3.model` for the architecture and the MTP loss, and
:mod:`lockstep.models.deepseek_v3.hf` for the Hugging Face mapping (``DeepseekV3ForCausalLM``).
"""

from __future__ import annotations

from lockstep.models.common.rope_yarn import YarnRopeConfig
from lockstep.models.deepseek_v3.hf import DeepSeekV3Adapter
from lockstep.models.deepseek_v3.model import (
    DeepSeekV3Config,
    DeepSeekV3Transformer,
    deepseek_v3_config,
    param_count,
)
from lockstep.models.registry import ModelSpec, register_model

_d = deepseek_v3_config


def _debug(flavor: str, q_lora_rank: int):
    # 3 layers (1 dense + 2 MoE), group-limited routing (4 groups of 2, best 2 groups), YaRN x4, 1 MTP depth.
    return _d(flavor, vocab_size=4096, dim=64, n_layers=3, n_heads=4, ffn_dim=128, max_seq_len=512,
              q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              n_experts=8, top_k=2, moe_ffn_dim=32, n_shared_experts=1, n_group=4, topk_group=2,
              first_k_dense_replace=1, n_mtp=1,
              rope=YarnRopeConfig(theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                                  mscale=1.0, mscale_all_dim=1.0))


def _deepseek_v3_671b():
    # deepseek-ai/DeepSeek-V3 config.json: 671.0B main-model parameters (37.6B active) + a 1-depth MTP module
    # (11.6B; 13.5B with the checkpoint's copies of the embedding and head).
    # Balancing as in the paper: bias update speed 0.001, sequence-wise aux loss alpha 1e-4, MTP lambda 0.3.
    return _d("671B", vocab_size=129280, dim=7168, n_layers=61, n_heads=128, ffn_dim=18432, max_seq_len=163840,
              q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
              n_experts=256, top_k=8, moe_ffn_dim=2048, n_shared_experts=1, n_group=8, topk_group=4,
              routed_scaling_factor=2.5, first_k_dense_replace=3, n_mtp=1, mtp_loss_weight=0.3,
              bias_update_speed=0.001, seq_aux_loss_coef=0.0001,
              rope=YarnRopeConfig(theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                                  beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))


def _kimi_k2():
    # moonshotai/Kimi-K2-Instruct config.json (model_type kimi_k2, DeepseekV3ForCausalLM): 1.026T parameters,
    # 32.9B active; 384 experts, one expert group, no MTP layer released. (Kimi-K2-Instruct-0905 extends the
    # context to 256k: YaRN factor 64, max_position_embeddings 262144; load its config.json for that.)
    return _d("kimi_k2", family="deepseek_v3", vocab_size=163840, dim=7168, n_layers=61, n_heads=64,
              ffn_dim=18432, max_seq_len=131072, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128, n_experts=384, top_k=8, moe_ffn_dim=2048, n_shared_experts=1,
              n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1, n_mtp=0,
              rope=YarnRopeConfig(theta=50000.0, factor=32.0, original_max_position_embeddings=4096,
                                  beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))


FLAVORS = {
    # tiny model for tests (q compression on): seconds per run
    "debug": lambda: _debug("debug", q_lora_rank=32),
    # the same without q compression (q = wq(x))
    "debug_noqlora": lambda: _debug("debug_noqlora", q_lora_rank=0),
    # CPU-trainable (14.3M parameters with a 4k vocab, 6.4M active per token, 2.0M in MTP): 6 layers, 16 experts
    # top-4 in 4 groups (best 2), 1 MTP depth, aux-loss-free balancing + sequence aux loss
    "tiny": lambda: _d("tiny", vocab_size=4096, dim=256, n_layers=6, n_heads=8, ffn_dim=768, max_seq_len=1024,
                       q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                       n_experts=16, top_k=4, moe_ffn_dim=128, n_shared_experts=1, n_group=4, topk_group=2,
                       first_k_dense_replace=1, n_mtp=1, bias_update_speed=0.001, seq_aux_loss_coef=0.0001,
                       rope=YarnRopeConfig(theta=10000.0, scaling="none")),
    "671B": _deepseek_v3_671b,
    "kimi_k2": _kimi_k2,
}

SPEC = register_model(
    ModelSpec(name="deepseek_v3", flavors=FLAVORS, hf_model_types=("deepseek_v3", "kimi_k2"),
              hf_adapter=DeepSeekV3Adapter(),
              description="DeepSeek-V3 / Kimi-K2 (MLA, dense-then-MoE with sigmoid group-limited routing, "
                          "YaRN, multi-token prediction)")
)

__all__ = ["FLAVORS", "SPEC", "DeepSeekV3Adapter", "DeepSeekV3Config", "DeepSeekV3Transformer",
           "deepseek_v3_config", "param_count"]
