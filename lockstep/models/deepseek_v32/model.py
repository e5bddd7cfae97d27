"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 with DeepSeek Sparse Attention.

The architecture is DeepSeek-V3's (:mod:`lockstep.models.deepseek_v3.model`: MLA, dense-then-MoE,
YaRN, optional MTP) with a lightning indexer in every MLA block
(:mod:`lockstep.models.common.sparse_indexer`, ``MLAConfig.indexer``): each query attends only to
its ``index_topk`` best keys. The config class is :class:`DeepSeekV3Config` (family
``deepseek_v32``); nothing else changes, so every DeepSeek-V3 code path (MTP, MoE, parallel plans,
generation) serves it.

Training: the language-model loss trains everything but the indexer; the indexer trains on its
own KL loss (``indexer.loss_weight``; ``indexer.stage="dense"`` for the paper's dense warm-up,
see the indexer module).
"""

from __future__ import annotations

import dataclasses

from lockstep.models.common.sparse_indexer import SparseIndexerConfig
from lockstep.models.common.sparse_indexer import param_count as indexer_param_count
from lockstep.models.deepseek_v3.model import DeepSeekV3Config, deepseek_v3_config
from lockstep.models.deepseek_v3.model import param_count as deepseek_v3_param_count

FAMILY = "deepseek_v32"


def deepseek_v32_config(flavor: str, *, index_n_heads: int, index_head_dim: int, index_topk: int,
                        index_loss_weight: float = 0.0, index_stage: str = "sparse", **hyper) -> DeepSeekV3Config:
    """A DeepSeek-V3.2 config from HF-like hyperparameters (those of :func:`deepseek_v3_config` plus
    the indexer's); ``q_lora_rank`` must be > 0 (the indexer reads the query latent)."""
    cfg = deepseek_v3_config(flavor, family=FAMILY, **hyper)
    indexer = SparseIndexerConfig(n_heads=index_n_heads, head_dim=index_head_dim, topk=index_topk,
                                  loss_weight=index_loss_weight, stage=index_stage)
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, indexer=indexer))


def param_count(config: DeepSeekV3Config) -> dict[str, int]:
    """DeepSeek-V3's counts (computed without building) plus one indexer per block (MTP blocks too)."""
    counts = deepseek_v3_param_count(config)
    per_layer = indexer_param_count(config.attention.indexer, config.dim, config.attention.q_lora_rank)
    counts["indexer_per_layer"] = per_layer
    counts["total"] += per_layer * (config.n_layers + config.n_mtp)
    counts["active"] += per_layer * config.n_layers
    counts["mtp"] += per_layer * config.n_mtp
    return counts


__all__ = ["FAMILY", "deepseek_v32_config", "param_count"]
