"""Hugging Face interop for DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, transformers 5.19).

Everything DeepSeek-V3's adapter maps (:mod:`lockstep.models.deepseek_v3.hf`, MTP included), plus
per block ``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`` <-> ``attention.indexer.{...}``
(``k_norm`` is a LayerNorm: weight and bias) and the config fields ``index_n_heads``,
``index_head_dim``, ``index_topk``. DeepSeek-V3.2 always rotates MLA's rope dims interleaved (its
config has no ``rope_interleave``) and always compresses queries (``q_lora_rank`` set); its
``mlp_layer_types`` must be ``first_k_dense_replace`` dense layers then MoE. transformers keeps
``indexer.weights_proj`` in fp32 when loading in bf16; lockstep keeps one dtype per model.
The indexer's training knobs (``loss_weight``, ``stage``) are not in ``config.json``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lockstep.config.base import ConfigError
from lockstep.models.common.mla import MLAConfig
from lockstep.models.common.sparse_indexer import SparseIndexerConfig
from lockstep.models.common.transformer import TransformerConfig
from lockstep.models.deepseek_v3.hf import DeepSeekV3Adapter
from lockstep.models.deepseek_v3.model import DeepSeekV3Config
from lockstep.models.deepseek_v32.model import FAMILY

_INDEXER = {"wq_b.weight": "wq_b.weight", "wk.weight": "wk.weight", "k_norm.weight": "k_norm.weight",
            "k_norm.bias": "k_norm.bias", "weights_proj.weight": "weights_proj.weight"}


class DeepSeekV32Adapter(DeepSeekV3Adapter):
    """HFAdapter for ``DeepseekV32ForCausalLM`` checkpoints (``model_type`` ``deepseek_v32``)."""

    def config_from_hf(self, hf_config: dict[str, Any]) -> TransformerConfig:
        hf = hf_config
        if not hf.get("q_lora_rank"):
            raise ConfigError("config.json q_lora_rank: DeepSeek-V3.2's indexer reads the query latent; must be set")
        n_layers, k = hf["num_hidden_layers"], hf.get("first_k_dense_replace") or 0
        types = hf.get("mlp_layer_types")
        if types is not None and list(types) != ["dense"] * min(k, n_layers) + ["sparse"] * max(n_layers - k, 0):
            raise ConfigError(f"config.json mlp_layer_types {types}: only first_k_dense_replace={k} dense layers "
                              "then MoE layers are supported")
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            if name not in hf:
                raise ConfigError(f"config.json {name}: missing (a DeepSeek-V3.2 config has the indexer's sizes)")
        base = super().config_from_hf({**hf, "rope_interleave": True})
        indexer = SparseIndexerConfig(n_heads=hf["index_n_heads"], head_dim=hf["index_head_dim"],
                                      topk=hf["index_topk"])
        cfg = dataclasses.replace(base, family=FAMILY, attention=dataclasses.replace(base.attention, indexer=indexer))
        cfg.validate()
        return cfg

    def config_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        att = config.attention
        if not isinstance(att, MLAConfig) or att.indexer is None:
            raise ConfigError("model.attention.indexer: the deepseek_v32 HF adapter needs MLA with a sparse indexer")
        if not att.rope_interleave:
            raise ConfigError("model.attention.rope_interleave: HF DeepseekV32 always rotates interleaved pairs")
        out = super().config_to_hf(config)
        out.pop("rope_interleave")
        n_dense = min(config.first_k_dense_replace, config.n_layers)
        out.update({
            "architectures": ["DeepseekV32ForCausalLM"],
            "model_type": "deepseek_v32",
            "index_n_heads": att.indexer.n_heads,
            "index_head_dim": att.indexer.head_dim,
            "index_topk": att.indexer.topk,
            "mlp_layer_types": ["dense"] * n_dense + ["sparse"] * (config.n_layers - n_dense),
        })
        return out

    def _block_names(self, config: DeepSeekV3Config, ls: str, hf: str, moe: bool) -> dict[str, str]:
        names = super()._block_names(config, ls, hf, moe)
        for mine, theirs in _INDEXER.items():
            names[f"{ls}.attention.indexer.{mine}"] = f"{hf}.self_attn.indexer.{theirs}"
        return names


__all__ = ["DeepSeekV32Adapter"]
