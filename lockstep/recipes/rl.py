"""RL recipes: functions returning a whole ``RLConfig`` (run with ``lockstep rl --recipe NAME``).

- ``rl-debug``: a 0.6M-parameter random llama3 on the dense-reward ``echo`` task (every group has
  reward variance, so every step changes the weights); a handful of steps in seconds, one trainer
  + one generator process (for tests and smoke runs).
- ``rl-debug-moe``: ``rl-debug`` with a random ``qwen3_moe`` debug model (8 experts, top-2), for the
  expert-parallel layouts (``parallel.ep`` with ``tp`` / ``dp_replicate``, ``workers.generator_parallel.ep``).
- ``rl-arith-tiny``: a 1.6M-parameter llama3 learns the answer format and some one-digit sums by
  SFT, then DAPO (GRPO advantages, clip-higher, token-level loss, flat groups filtered) raises its
  greedy pass rate on held-out task seeds.
- ``rl-smollm2``: SmolLM2-135M-Instruct (real weights) on reasoning-gym arithmetic with GRPO.
- ``rl-long-prompt``: ``rl-debug`` with prompts of ~3.5k tokens (the echo task behind a long
  filler document), prefilled in chunks of 512 tokens (``engine.prefill_chunk``).
- ``rl-qwen35-tiny``: a random Qwen3.5 MoE ``tiny-moe`` (Gated DeltaNet hybrid) on the echo task in
  batch-invariant mode: trainer and generator log-probabilities agree exactly (docs/hybrid.md).
"""

from __future__ import annotations

from lockstep.data.config import DataConfig
from lockstep.generate.config import EngineConfig, SamplingParams
from lockstep.models.registry import model_config
from lockstep.numerics import NumericsConfig
from lockstep.recipes.registry import recipe
from lockstep.recipes.smollm2 import INIT_FROM, smollm2_config
from lockstep.rl.config import RLConfig, RLOutputConfig, RLTrainingConfig, SFTConfig, TaskConfig, WorkersConfig
from lockstep.rl.losses import LossConfig
from lockstep.rl.rollout import RolloutConfig
from lockstep.train.optim import AdamWConfig, LRScheduleConfig

#: sums of two one-digit numbers (reasoning-gym basic_arithmetic): 100 distinct problems
SMALL_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                    "allow_parentheses": False, "allow_negation": False}
#: a short prompt for a small model: the answer is the reply's last number
ARITH_OPTIONS = {"dataset_kwargs": SMALL_ARITHMETIC, "system_prompt": "Answer.", "answer_format": "last_number"}


@recipe("rl-debug", "RL smoke run: random llama3 debug (0.6M) on the dense-reward echo task, trainer + 1 "
        "generator, seconds")
def rl_debug() -> RLConfig:
    return RLConfig(
        steps=3,
        model=model_config("llama3", "debug"),
        data=DataConfig(),
        task=TaskConfig(env="echo", groups_per_step=2),
        rollout=RolloutConfig(group_size=4, sampling=SamplingParams(max_new_tokens=12, temperature=1.0)),
        engine=EngineConfig(cache_memory_mb=16, max_batch_size=16),
        loss=LossConfig(kind="grpo"),
        optimizer=AdamWConfig(lr=1e-3, weight_decay=0.0),
        workers=WorkersConfig(generators=1, max_offpolicy_steps=0),
        output=RLOutputConfig(progress=False),
    )


@recipe("rl-debug-moe", "rl-debug with a random qwen3_moe debug model (8 experts, top-2): the expert-parallel trainer "
        "and generator layouts (parallel.ep, workers.generator_parallel.ep) on a model in seconds")
def rl_debug_moe() -> RLConfig:
    cfg = rl_debug()
    cfg.model = model_config("qwen3_moe", "debug")
    return cfg


@recipe("rl-long-prompt", "RL with ~3.5k-token prompts on this CPU: rl-debug's model (context 4096) on the echo "
        "task behind a long document, chunked prefill")
def rl_long_prompt() -> RLConfig:
    cfg = rl_debug()
    cfg.steps = 2
    cfg.model.max_seq_len = 4096
    cfg.task = TaskConfig(env="echo", groups_per_step=1, options={"preamble_words": 2400})
    cfg.rollout.group_size = 4
    cfg.engine = EngineConfig(cache_memory_mb=64, max_batch_size=8, max_prefill_tokens=16384, prefill_chunk=512)
    return cfg


@recipe("rl-qwen35-tiny", "RL on a random Qwen3.5 MoE tiny (Gated DeltaNet hybrid) on the echo task, "
        "batch-invariant: trainer == generator log-probabilities")
def rl_qwen35_tiny() -> RLConfig:
    cfg = rl_debug()
    cfg.model = model_config("qwen3_5", "tiny-moe")
    cfg.numerics = NumericsConfig(batch_invariant=True)
    return cfg


def _arith_tiny_model():
    cfg = model_config("llama3", "debug")
    cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim = 128, 4, 4, 2, 384
    cfg.flavor = "arith"
    return cfg


@recipe("rl-arith-tiny", "SFT then DAPO of a 1.6M llama3 on one-digit sums (reasoning-gym); held-out pass rate rises")
def rl_arith_tiny() -> RLConfig:
    return RLConfig(
        steps=150,
        model=_arith_tiny_model(),
        data=DataConfig(),
        task=TaskConfig(env="reasoning_gym:basic_arithmetic", groups_per_step=16, eval_tasks=200, eval_every=25,
                        options=ARITH_OPTIONS),
        rollout=RolloutConfig(group_size=8, sampling=SamplingParams(max_new_tokens=6, temperature=1.0)),
        engine=EngineConfig(cache_memory_mb=64, max_batch_size=128),
        loss=LossConfig(kind="dapo", clip_high=0.28, filter_zero_variance_groups=True),
        optimizer=AdamWConfig(lr=4e-4, weight_decay=0.0),
        sft=SFTConfig(steps=220, batch_size=32, lr=3e-3, response_template=" {answer}"),
        workers=WorkersConfig(generators=1, max_offpolicy_steps=1),
        output=RLOutputConfig(progress=True),
    )


@recipe("rl-smollm2", "GRPO of SmolLM2-135M-Instruct (real weights) on reasoning-gym chain_sum; slow on CPU")
def rl_smollm2() -> RLConfig:
    return RLConfig(
        steps=10,
        init_from=INIT_FROM,
        model=smollm2_config(max_seq_len=2048),
        task=TaskConfig(env="reasoning_gym:chain_sum", groups_per_step=4, eval_tasks=24, eval_every=5,
                        options={"dataset_kwargs": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
                                 "answer_format": "last_number"}),
        rollout=RolloutConfig(group_size=4, sampling=SamplingParams(max_new_tokens=48, temperature=1.0)),
        engine=EngineConfig(cache_memory_mb=256, max_batch_size=16),
        loss=LossConfig(kind="grpo"),
        optimizer=AdamWConfig(lr=2e-6, weight_decay=0.0),
        lr_schedule=LRScheduleConfig(kind="constant", warmup_steps=0),
        training=RLTrainingConfig(micro_batch_size=4),
        workers=WorkersConfig(generators=1, max_offpolicy_steps=1),
        output=RLOutputConfig(progress=True, print_samples=1),
    )
