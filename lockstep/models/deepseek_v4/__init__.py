"""DeepSeek-V4 family (``deepseek_v4``): mHC residual streams, compressed sparse / heavily compressed
attention, sqrt-softplus and hash-routed MoE. See :mod:`lockstep.models.deepseek_v4.model` and
:mod:`lockstep.models.deepseek_v4.hf`."""

from __future__ import annotations

from lockstep.models.common.moe import MoEConfig
from lockstep.models.deepseek_v4.hf import DeepSeekV4Adapter
from lockstep.models.deepseek_v4.model import FAMILY, DeepSeekV4Config
from lockstep.models.registry import ModelSpec, register_model


def _debug() -> DeepSeekV4Config:
    # 4 blocks covering every attention kind (HCA, CSA, sliding, CSA) and both routings; windows of 4 (CSA) and
    # 8 (HCA) tokens, 4 indexer picks, a sliding window of 8: sequences of a few dozen tokens use all paths.
    return DeepSeekV4Config(
        flavor="debug", vocab_size=4096, dim=64, n_layers=4, n_heads=4, head_dim=32, rope_dim=8, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, sliding_window=8, csa_rate=4, hca_rate=8, index_n_heads=4, index_head_dim=16,
        index_topk=4, hc_mult=4, ffn_dim=32, max_seq_len=512,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        feed_forward=MoEConfig(n_routed_experts=8, n_activated=2, moe_ffn_dim=32, n_shared_experts=1,
                               score_func="sigmoid", routed_scaling_factor=1.5))


def _flash() -> DeepSeekV4Config:
    # transformers' DeepseekV4Config defaults (deepseek-ai/DeepSeek-V4-Flash-Base shapes): 43 layers,
    # 2 HCA then CSA/HCA interleaved, 3 hash-routed MoE layers then learned routing (MTP not counted).
    n = 43
    layer_types = ["heavily_compressed_attention"] * 2 + [
        "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(n - 2)]
    return DeepSeekV4Config(
        flavor="flash", vocab_size=129280, dim=4096, n_layers=n, n_heads=64, head_dim=512, rope_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, csa_rate=4, hca_rate=128,
        index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4, ffn_dim=2048, max_seq_len=1048576,
        norm_eps=1e-6, layer_types=layer_types, mlp_layer_types=["hash_moe"] * 3 + ["moe"] * (n - 3),
        feed_forward=MoEConfig(n_routed_experts=256, n_activated=6, moe_ffn_dim=2048, n_shared_experts=1,
                               score_func="sigmoid", routed_scaling_factor=1.5))


FLAVORS = {"debug": _debug, "flash": _flash}

SPEC = register_model(
    ModelSpec(name=FAMILY, flavors=FLAVORS, hf_model_types=("deepseek_v4",), hf_adapter=DeepSeekV4Adapter(),
              description="DeepSeek-V4 (hyper-connections, compressed sparse / heavily compressed attention, "
                          "sqrt-softplus and hash-routed MoE)")
)

__all__ = ["FLAVORS", "SPEC", "DeepSeekV4Adapter", "DeepSeekV4Config"]
