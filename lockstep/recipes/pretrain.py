"""Pretraining recipes on the embedded Shakespeare corpus."""

from __future__ import annotations

import dataclasses

from lockstep.data.config import DataConfig
from lockstep.models.registry import model_config
from lockstep.recipes.registry import recipe
from lockstep.train.config import OutputConfig, TrainerConfig, TrainingConfig, ValidationConfig
from lockstep.train.optim import AdamWConfig, LRScheduleConfig


@recipe("debug", "tiny llama3 (0.6M params) on Shakespeare, seq 64: seconds per run, for tests")
def debug() -> TrainerConfig:
    return TrainerConfig(
        steps=20,
        model=model_config("llama3", "debug"),
        data=DataConfig(),
        optimizer=AdamWConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=2),
        training=TrainingConfig(batch_size=4, seq_len=64),
        validation=ValidationConfig(every=10, batches=2),
        output=OutputConfig(sample_tokens=16, parity_check=False),
    )


@recipe("shakespeare", "llama3 tiny (6.8M params) on Shakespeare in bf16: the `make run` default, ~6 min on 2 cores")
def shakespeare() -> TrainerConfig:
    return TrainerConfig(
        steps=600,
        model=model_config("llama3", "tiny"),
        data=DataConfig(),
        optimizer=AdamWConfig(lr=2e-3, weight_decay=0.1),
        lr_schedule=LRScheduleConfig(kind="cosine", warmup_steps=50, min_lr_ratio=0.1),
        training=TrainingConfig(batch_size=16, seq_len=256, dtype="bfloat16"),
        validation=ValidationConfig(every=100, batches=16),
        output=OutputConfig(sample_tokens=80),
    )


@recipe("shakespeare-qwen3", "qwen3 tiny (q/k norm, tied embeddings) on Shakespeare in bf16")
def shakespeare_qwen3() -> TrainerConfig:
    cfg = shakespeare()
    cfg.model = model_config("qwen3", "tiny")
    return cfg


@recipe("shakespeare-small", "llama3 small (29M params) on Shakespeare in bf16, WSD schedule: tens of minutes")
def shakespeare_small() -> TrainerConfig:
    cfg = shakespeare()
    cfg.steps = 1500
    cfg.model = model_config("llama3", "small")
    cfg.optimizer = AdamWConfig(lr=1e-3)
    cfg.lr_schedule = LRScheduleConfig(kind="wsd", warmup_steps=100, decay_fraction=0.2)
    return cfg


@recipe("debug-qwen3", "tiny qwen3 (q/k norm, tied embeddings) on Shakespeare: seconds per run, for tests")
def debug_qwen3() -> TrainerConfig:
    cfg = debug()
    cfg.model = model_config("qwen3", "debug")
    return cfg


@recipe("debug-moe", "tiny qwen3_moe (routed experts) on Shakespeare: seconds per run, for tests")
def debug_moe() -> TrainerConfig:
    cfg = debug()
    cfg.model = model_config("qwen3_moe", "debug")
    return cfg


@recipe("debug-deepseek", "tiny deepseek_v3 (MLA, MoE with aux-loss-free balancing, MTP) on Shakespeare, for tests")
def debug_deepseek() -> TrainerConfig:
    cfg = debug()
    cfg.model = model_config("deepseek_v3", "debug")
    return cfg


@recipe("debug-deepseek-v32",
        "tiny deepseek_v32 (deepseek_v3 + sparse-attention indexer, its KL loss on) on Shakespeare, for tests")
def debug_deepseek_v32() -> TrainerConfig:
    cfg = debug()
    cfg.model = model_config("deepseek_v32", "debug")
    indexer = dataclasses.replace(cfg.model.attention.indexer, loss_weight=1.0)
    cfg.model = dataclasses.replace(cfg.model, attention=dataclasses.replace(cfg.model.attention, indexer=indexer))
    return cfg


@recipe("debug-deepseek-v4",
        "tiny deepseek_v4 (hyper-connections, CSA/HCA compressed attention, hash + learned routing), for tests")
def debug_deepseek_v4() -> TrainerConfig:
    cfg = debug()
    cfg.model = model_config("deepseek_v4", "debug")
    return cfg


@recipe("debug-gptoss", "tiny gpt_oss (sliding/full attention with sinks, clamped SwiGLU experts) on Shakespeare, for tests")
def debug_gptoss() -> TrainerConfig:
    cfg = debug()
    cfg.model = model_config("gpt_oss", "debug")
    return cfg


@recipe("debug-qwen35", "tiny qwen3_5 (Gated DeltaNet + gated attention 3:1, dense) on Shakespeare, for tests")
def debug_qwen35() -> TrainerConfig:
    cfg = debug()
    cfg.model = model_config("qwen3_5", "debug")
    return cfg


@recipe("debug-qwen35-moe", "tiny qwen3_5 MoE (Gated DeltaNet hybrid, experts + gated shared expert), for tests")
def debug_qwen35_moe() -> TrainerConfig:
    cfg = debug()
    cfg.model = model_config("qwen3_5", "debug-moe")
    return cfg


@recipe("debug-qwen3next", "tiny qwen3_next (Gated DeltaNet hybrid, grouped projections, MoE), for tests")
def debug_qwen3next() -> TrainerConfig:
    cfg = debug()
    cfg.model = model_config("qwen3_next", "debug")
    return cfg


@recipe("shakespeare-moe", "qwen3_moe tiny (16 experts, top-4) on Shakespeare in bf16")
def shakespeare_moe() -> TrainerConfig:
    cfg = shakespeare()
    cfg.model = model_config("qwen3_moe", "tiny")
    return cfg
