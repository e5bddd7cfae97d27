"""DeepSeek-V3.2 family (``deepseek_v32``): DeepSeek-V3 plus the sparse-attention lightning indexer.

See :mod:`lockstep.models.deepseek_v32.model` (architecture), :mod:`lockstep.models.common.sparse_indexer`
(the indexer, its top-k selection and its KL loss) and :mod:`lockstep.models.deepseek_v32.hf`
(``DeepseekV32ForCausalLM`` checkpoints).
"""

from __future__ import annotations

from lockstep.models.common.rope_yarn import YarnRopeConfig
from lockstep.models.deepseek_v32.hf import DeepSeekV32Adapter
from lockstep.models.deepseek_v32.model import FAMILY, deepseek_v32_config, param_count
from lockstep.models.registry import ModelSpec, register_model

_d = deepseek_v32_config


def _debug():
    # DeepSeek-V3's debug flavor (3 layers, 1 dense + 2 MoE, grouped routing, YaRN x4, 1 MTP depth) with an
    # 8-head indexer keeping 8 keys per query: sequences past 8 tokens attend sparsely.
    return _d("debug", vocab_size=4096, dim=64, n_layers=3, n_heads=4, ffn_dim=128, max_seq_len=512,
              q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              n_experts=8, top_k=2, moe_ffn_dim=32, n_shared_experts=1, n_group=4, topk_group=2,
              first_k_dense_replace=1, n_mtp=1, index_n_heads=8, index_head_dim=16, index_topk=8,
              rope=YarnRopeConfig(theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                                  mscale=1.0, mscale_all_dim=1.0))


def _deepseek_v32_exp():
    # deepseek-ai/DeepSeek-V3.2-Exp config.json: DeepSeek-V3's 671B shapes plus a 64-head indexer
    # (head dim 128) keeping 2048 keys per query.
    return _d("671B", vocab_size=129280, dim=7168, n_layers=61, n_heads=128, ffn_dim=18432, max_seq_len=163840,
              q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
              n_experts=256, top_k=8, moe_ffn_dim=2048, n_shared_experts=1, n_group=8, topk_group=4,
              routed_scaling_factor=2.5, first_k_dense_replace=3, n_mtp=1, mtp_loss_weight=0.3,
              bias_update_speed=0.001, seq_aux_loss_coef=0.0001,
              index_n_heads=64, index_head_dim=128, index_topk=2048,
              rope=YarnRopeConfig(theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                                  beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))


FLAVORS = {
    # tiny model for tests (seconds per run), top-8 sparse attention
    "debug": _debug,
    # CPU-trainable: DeepSeek-V3's tiny flavor with an 8-head indexer keeping 64 keys, KL loss on (weight 1)
    "tiny": lambda: _d("tiny", vocab_size=4096, dim=256, n_layers=6, n_heads=8, ffn_dim=768, max_seq_len=1024,
                       q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                       n_experts=16, top_k=4, moe_ffn_dim=128, n_shared_experts=1, n_group=4, topk_group=2,
                       first_k_dense_replace=1, n_mtp=1, bias_update_speed=0.001, seq_aux_loss_coef=0.0001,
                       index_n_heads=8, index_head_dim=32, index_topk=64, index_loss_weight=1.0,
                       rope=YarnRopeConfig(theta=10000.0, scaling="none")),
    "671B": _deepseek_v32_exp,
}

SPEC = register_model(
    ModelSpec(name=FAMILY, flavors=FLAVORS, hf_model_types=("deepseek_v32",), hf_adapter=DeepSeekV32Adapter(),
              description="DeepSeek-V3.2 (DeepSeek-V3 + DeepSeek Sparse Attention: a lightning indexer picks "
                          "each query's top-k keys for MLA)")
)

__all__ = ["FLAVORS", "SPEC", "DeepSeekV32Adapter", "deepseek_v32_config", "param_count"]
