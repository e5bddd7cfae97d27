"""The root of an RL run's config tree: ``RLConfig`` and its sections.

A recipe (``lockstep/recipes/rl.py``) returns one ``RLConfig``; ``lockstep rl`` resolves field flags
on it (``--rollout.group-size 8``, ``--workers.max-offpolicy-steps 1``) exactly as ``lockstep train``
does for a ``TrainerConfig``. The model section is the same ``TransformerConfig`` pretraining uses.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lockstep.checkpoint.config import CheckpointConfig
from lockstep.config.base import ALLOW_INF, Config, ConfigError, require, require_choice
from lockstep.config.run import RunConfig
from lockstep.data.config import DataConfig
from lockstep.generate.config import EngineConfig, SamplingParams
from lockstep.models.common.sparse_indexer import refuse_batch_invariant
from lockstep.models.common.transformer import TransformerConfig
from lockstep.numerics import NumericsConfig
from lockstep.parallel.dims import ParallelConfig
from lockstep.rl.losses import LossConfig
from lockstep.rl.rollout import RolloutConfig
from lockstep.run.config import SinkOutputs, validate_device
from lockstep.run.nonfinite import validate_nonfinite
from lockstep.train.config import TRAINING_MODES, require_batch_invariant_on_cpu
from lockstep.train.optim import AdamWConfig, LRScheduleConfig

#: ``workers.engine`` choices: lockstep's own engine, or vLLM running lockstep's modules (lockstep.vllm)
GENERATOR_ENGINES = ["lockstep", "vllm"]
#: what the loss's importance ratio divides by (see RLTrainingConfig.ratio_to)
RATIO_TO = ["generator", "current"]
#: ``workers.weight_sync`` choices (see WorkersConfig.weight_sync)
WEIGHT_SYNCS = ["auto", "reshard", "gather"]


@dataclasses.dataclass(kw_only=True)
class TaskConfig(Config):
    """The environment and which task seeds train, warm up and evaluate on.

    Step ``i`` (1-based) trains on task seeds ``train_seed_offset + (i - 1) * groups_per_step + j``;
    SFT warm-up step ``s`` uses ``sft_seed_offset + s * sft.batch_size + j``; evaluation uses
    ``eval_seed_offset + j``. The three ranges must not overlap (checked), so evaluation is on
    held-out tasks.
    """

    #: environment name (``lockstep.rl.envs.list_environments()``): "reasoning_gym:chain_sum", "math", "calculator", ...
    env: str = "reasoning_gym:basic_arithmetic"
    #: fields of that environment's config, e.g. {"dataset_kwargs": {"min_terms": 2, "max_terms": 2}}
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: tasks (GRPO groups of rollout.group_size episodes) per RL step
    groups_per_step: int = 4
    #: first task seed of RL training
    train_seed_offset: int = 0
    #: first task seed of the SFT warm-up
    sft_seed_offset: int = 20_000
    #: first task seed of the held-out evaluation
    eval_seed_offset: int = 50_000
    #: held-out tasks per evaluation (greedy, one sample each)
    eval_tasks: int = 32
    #: evaluate every N RL steps, before the first and after the last (0 = never)
    eval_every: int = 0
    #: an episode whose reward is >= this counts as passed
    pass_threshold: float = 1.0

    def validate(self, path: str = "task") -> None:
        require(isinstance(self.options, dict), f"{path}.options", "must be a dict of environment config fields")
        self.environment_config()
        require(self.groups_per_step >= 1, f"{path}.groups_per_step", f"must be >= 1, got {self.groups_per_step}")
        for name in ("train_seed_offset", "sft_seed_offset", "eval_seed_offset"):
            require(getattr(self, name) >= 0, f"{path}.{name}", f"must be >= 0, got {getattr(self, name)}")
        require(self.eval_tasks >= 1, f"{path}.eval_tasks", f"must be >= 1, got {self.eval_tasks}")
        require(self.eval_every >= 0, f"{path}.eval_every", f"must be >= 0, got {self.eval_every}")

    def environment_config(self) -> Config:
        from lockstep.rl.envs import environment_config

        try:
            return environment_config(self.env, **dict(self.options))
        except ConfigError as err:
            raise ConfigError(f"task (env={self.env!r}, options): {err}") from None

    def build(self) -> Any:
        """The environment (every process builds its own; ``reset`` is deterministic in the seed)."""
        return self.environment_config().build()

    def train_seeds(self, step: int) -> list[int]:
        start = self.train_seed_offset + (step - 1) * self.groups_per_step
        return list(range(start, start + self.groups_per_step))

    def sft_seeds(self, sft_step: int, batch_size: int) -> list[int]:
        start = self.sft_seed_offset + sft_step * batch_size
        return list(range(start, start + batch_size))

    def eval_seeds(self) -> list[int]:
        return list(range(self.eval_seed_offset, self.eval_seed_offset + self.eval_tasks))


@dataclasses.dataclass(kw_only=True)
class GeneratorParallelConfig(Config):
    """The layout of each generator: a group of ``tp x ep`` processes running the engine together
    (``lockstep.generate.parallel``: tensor-parallel, expert-parallel for MoE, or both: ep rows of tp ranks)."""

    #: tensor-parallel degree of each generator (attention heads, FFN hidden dim, vocabulary split)
    tp: int = 1
    #: expert-parallel degree of each generator (MoE models: each process holds n_experts/ep experts)
    ep: int = 1

    @property
    def size(self) -> int:
        """Processes of one generator group."""
        return self.tp * self.ep

    def validate(self, path: str = "workers.generator_parallel") -> None:
        for name in ("tp", "ep"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"{path}.{name}", f"must be an integer >= 1, got {value!r}")


@dataclasses.dataclass(kw_only=True)
class WorkersConfig(Config):
    """Which processes generate, and how far behind the trainer their policy may be."""

    #: generator processes beside the trainer in one torchrun job (0 = colocated: the trainer's own
    #: process generates with its own modules between steps; strictly synchronous)
    generators: int = 1
    #: a rollout trained on at step i was generated by policy version >= i - 1 - this (0 = on-policy:
    #: each step waits for rollouts of the weights it just produced; 1 = generation of the next batch
    #: overlaps training of this one)
    max_offpolicy_steps: int = 0
    #: intra-op threads of each generator process (0 = torch's default; torchrun sets 1)
    generator_threads: int = 0
    #: what the generator processes generate with: "lockstep" (lockstep.generate.Engine) or "vllm"
    #: (lockstep.vllm.VllmEngine: vLLM running lockstep's modules; each weights version is loaded into it in place)
    engine: str = "lockstep"
    #: each generator's own layout: a group of tp x ep processes (rank 0 of the group talks to the trainer)
    generator_parallel: GeneratorParallelConfig = dataclasses.field(default_factory=GeneratorParallelConfig)
    #: how a weights version reaches the generators: "reshard" (every trainer rank sends each generator rank
    #: the slices it holds, point to point: nobody gathers the model), "gather" (trainer rank 0 gathers the
    #: whole model and broadcasts one flat buffer to each one-process generator) or "auto" ("gather" when
    #: the trainer is one process and generators are one process each -- the same bytes, one broadcast --
    #: else "reshard")
    weight_sync: str = "auto"

    def resolved_weight_sync(self, trainer_world: int) -> str:
        """"reshard" or "gather" (``weight_sync`` with "auto" decided)."""
        if self.weight_sync != "auto":
            return self.weight_sync
        return "gather" if trainer_world == 1 and self.generator_parallel.size == 1 else "reshard"

    def validate(self, path: str = "workers") -> None:
        require(self.generators >= 0, f"{path}.generators", f"must be >= 0, got {self.generators}")
        require(self.max_offpolicy_steps >= 0, f"{path}.max_offpolicy_steps",
                f"must be >= 0, got {self.max_offpolicy_steps}")
        require(self.generators > 0 or self.max_offpolicy_steps == 0, f"{path}.max_offpolicy_steps",
                "asynchronous rollouts need generator processes (workers.generators >= 1); colocated "
                "generation (generators=0) is synchronous")
        require(self.generator_threads >= 0, f"{path}.generator_threads", f"must be >= 0, got {self.generator_threads}")
        require_choice(self.engine, GENERATOR_ENGINES, f"{path}.engine")
        require(self.engine == "lockstep" or self.generators >= 1, f"{path}.engine",
                f"{self.engine!r} runs in generator processes (workers.generators >= 1); colocated generation uses "
                f"lockstep's engine")
        self.generator_parallel.validate(f"{path}.generator_parallel")
        size = self.generator_parallel.size
        require(size == 1 or self.generators >= 1, f"{path}.generator_parallel",
                f"a generator group of {size} processes needs generator processes (workers.generators >= 1)")
        require(size == 1 or self.engine == "lockstep", f"{path}.engine",
                f"generator groups (generator_parallel tp x ep = {size}) run lockstep's engine, not {self.engine!r}")
        require_choice(self.weight_sync, WEIGHT_SYNCS, f"{path}.weight_sync")
        require(size == 1 or self.weight_sync != "gather", f"{path}.weight_sync",
                f"'gather' broadcasts the whole model to one-process generators; a generator group of {size} "
                f"processes takes its slices with 'reshard' (or 'auto')")



#: what the trainer does when a generator process stops answering (see LivenessConfig)
ON_GENERATOR_LOSS = ["stop", "continue"]


@dataclasses.dataclass(kw_only=True)
class LivenessConfig(Config):
    """Heartbeats between trainer rank 0 and the generator processes (``lockstep.rl.liveness``)."""

    #: a process not heard from for this many seconds is lost (stalled: SIGSTOP, a hang, a machine gone);
    #: one whose connection closes is lost at once (it died)
    timeout_s: float = 60.0
    #: a lost generator: "stop" the run (exit 3; the last checkpoint stays the newest) or "continue"
    #: with the remaining generators, which take over its batches (stops when none is left)
    on_generator_loss: str = "stop"

    def validate(self, path: str = "liveness") -> None:
        require(math.isfinite(self.timeout_s) and self.timeout_s > 0, f"{path}.timeout_s",
                f"must be a finite number > 0, got {self.timeout_s!r}")
        require_choice(self.on_generator_loss, ON_GENERATOR_LOSS, f"{path}.on_generator_loss")


@dataclasses.dataclass(kw_only=True)
class RLTrainingConfig(Config):
    """How the trainer turns a batch of episodes into one optimizer step."""

    #: sequences per forward/backward (0 = the whole step's batch in one pass)
    micro_batch_size: int = 0
    #: clip the global gradient norm to this (0 disables)
    max_grad_norm: float = dataclasses.field(default=1.0, metadata=ALLOW_INF)
    #: the importance ratio's denominator: "generator" (the logprobs recorded at sampling: the
    #: behaviour policy, so off-policy data is clipped like PPO) or "current" (the trainer's own,
    #: detached: ratio 1, the plain policy gradient; set loss.tis_cap to correct off-policy data)
    ratio_to: str = "generator"
    #: torch intra-op threads of the trainer (0 = torch's default)
    threads: int = 0
    #: where the trainer's model and batches live: "auto" (CUDA when available), "cpu" or "cuda"
    device: str = "auto"
    #: how a micro-batch's forward + backward runs: "eager" (autograd) or "graph" (captured as one FX graph
    #: with default passes, bitwise equal to eager; a micro-batch of other sequences re-captures)
    mode: str = "eager"
    #: non-finite loss/grad norm: "stop" (nothing saved from it), "skip_step" (drop the update), "rollback" (newest checkpoint)
    on_nonfinite: str = "stop"
    #: rollbacks allowed per run before on_nonfinite=rollback stops
    max_rollbacks: int = 3

    def validate(self, path: str = "training") -> None:
        require(self.micro_batch_size >= 0, f"{path}.micro_batch_size", f"must be >= 0, got {self.micro_batch_size}")
        require(self.max_grad_norm >= 0, f"{path}.max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        require_choice(self.ratio_to, RATIO_TO, f"{path}.ratio_to")
        require_choice(self.mode, TRAINING_MODES, f"{path}.mode")
        require(self.threads >= 0, f"{path}.threads", f"must be >= 0, got {self.threads}")
        validate_device(self.device, f"{path}.device")
        validate_nonfinite(self.on_nonfinite, self.max_rollbacks, path)


@dataclasses.dataclass(kw_only=True)
class SFTConfig(Config):
    """A supervised warm-up on the task format before RL (reference answers as targets)."""

    #: optimizer steps (0 = no warm-up)
    steps: int = 0
    #: tasks per step
    batch_size: int = 32
    #: AdamW learning rate (constant after a 10% warm-up)
    lr: float = 1e-3
    #: the target after the prompt; "{answer}" is the task's reference answer (an end-of-sequence
    #: token follows when the tokenizer has one)
    response_template: str = " <answer>{answer}</answer>"

    def validate(self, path: str = "sft") -> None:
        require(self.steps >= 0, f"{path}.steps", f"must be >= 0, got {self.steps}")
        require(self.batch_size >= 1, f"{path}.batch_size", f"must be >= 1, got {self.batch_size}")
        require(self.lr > 0, f"{path}.lr", f"must be > 0, got {self.lr}")
        require("{answer}" in self.response_template, f"{path}.response_template",
                "must contain {answer} (where the reference answer goes)")


@dataclasses.dataclass(kw_only=True)
class RLOutputConfig(SinkOutputs):
    """What an RL run prints and writes besides metrics.jsonl and the manifest (and the sinks' switches)."""

    #: show a progress bar on the console
    progress: bool = True
    #: write the final weights (model.safetensors) and tokenizer
    save_weights: bool = True
    #: print this many sampled episodes' texts every step (0 = none)
    print_samples: int = 0


@dataclasses.dataclass(kw_only=True)
class RLConfig(RunConfig):
    """A whole RL run: model, environment, rollouts, loss, optimizer, workers and outputs.

    ``init_from`` empty means a random init from ``model`` with the ``data`` tokenizer."""

    #: RL optimizer steps (the LR schedule spans them)
    steps: int = 10
    #: the model architecture (with init_from: checked against the checkpoint's)
    model: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
    #: the tokenizer when init_from is empty (its BPE tokenizer; the corpus itself is not used)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    #: the environment and task seeds
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    #: how episodes are sampled (group size, turns, sampling)
    rollout: RolloutConfig = dataclasses.field(default_factory=lambda: RolloutConfig(
        group_size=4, sampling=SamplingParams(max_new_tokens=32, temperature=1.0)))
    #: the generation engine of every generator (and of evaluation)
    engine: EngineConfig = dataclasses.field(default_factory=lambda: EngineConfig(cache_memory_mb=64))
    #: the policy loss
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    #: the optimizer
    optimizer: AdamWConfig = dataclasses.field(default_factory=lambda: AdamWConfig(lr=1e-5, weight_decay=0.0))
    #: the learning-rate schedule
    lr_schedule: LRScheduleConfig = dataclasses.field(default_factory=lambda: LRScheduleConfig(
        kind="constant", warmup_steps=0))
    #: micro-batching, clipping, the ratio's denominator
    training: RLTrainingConfig = dataclasses.field(default_factory=RLTrainingConfig)
    #: supervised warm-up before RL
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    #: generator processes and bounded staleness
    workers: WorkersConfig = dataclasses.field(default_factory=WorkersConfig)
    #: heartbeats between trainer and generators: the timeout, and what a lost generator does to the run
    liveness: LivenessConfig = dataclasses.field(default_factory=LivenessConfig)
    #: the trainer's own layout over its processes (ranks 0 .. T-1; the generators come after):
    #: dp_replicate (HSDP) x dp_shard (FSDP2) x tp (tensor/sequence parallel), and ep (MoE experts over the
    #: dp_shard ranks); pp and cp are refused
    parallel: ParallelConfig = dataclasses.field(default_factory=lambda: ParallelConfig(dp_shard=1))
    #: periodic full-state checkpoints (policy, optimizer, RNG, task position, policy version)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    #: numerics switches (batch-invariant kernels in trainer and generators)
    numerics: NumericsConfig = dataclasses.field(default_factory=NumericsConfig)
    #: console and output files
    output: RLOutputConfig = dataclasses.field(default_factory=RLOutputConfig)

    def validate(self, path: str = "") -> None:
        self.validate_run()
        for name in ("model", "data", "task", "rollout", "engine", "loss", "optimizer", "lr_schedule", "training",
                     "sft", "workers", "liveness", "parallel", "checkpoint", "numerics", "output"):
            getattr(self, name).validate(name)
        require_batch_invariant_on_cpu(self.numerics, self.training.device)  # trainer and generators
        refuse_batch_invariant(self.model, self.numerics.batch_invariant)
        self._check_trainer_layout()
        require(self.lr_schedule.warmup_steps <= self.steps, "lr_schedule.warmup_steps",
                f"must be <= steps={self.steps}, got {self.lr_schedule.warmup_steps}")
        kind = self.loss.kind
        if kind in ("grpo", "dapo"):
            require(self.rollout.group_size >= 2, "rollout.group_size",
                    f"loss.kind={kind!r} normalises by the group's std and needs group_size >= 2, "
                    f"got {self.rollout.group_size}")
        require(not (self.loss.tis_cap > 0 and self.training.ratio_to == "generator"), "loss.tis_cap",
                "with training.ratio_to='generator' the ratio already divides by the generator's "
                "logprobs (the truncated IS weight would be 1); use ratio_to='current' with tis_cap")
        self._check_seed_ranges()

    @property
    def trainer_world_size(self) -> int:
        """Processes of the trainer: dp_replicate x dp_shard x tp x pp (ep borrows dp_shard's ranks)."""
        return self.parallel.dp_replicate * self.parallel.dp_shard * self.parallel.tp * self.parallel.pp

    @property
    def trainer_dp(self) -> int:
        """Data-parallel trainer ranks (each scores its own share of a step's episodes; tp ranks share one)."""
        return self.parallel.dp_replicate * self.parallel.dp_shard

    @property
    def world_size(self) -> int:
        """Processes of the job: the trainer's, then each generator's group (``generator_parallel`` tp x ep)."""
        return self.trainer_world_size + self.workers.generators * self.workers.generator_parallel.size

    def _check_trainer_layout(self) -> None:
        par = self.parallel
        require(par.dp_shard >= 1, "parallel.dp_shard",
                f"an RL trainer's dp_shard must be given (>= 1; -1 'the rest' would take the generators' ranks), "
                f"got {par.dp_shard}")
        require(par.cp == 1, "parallel.cp",
                f"the RL trainer supports dp_replicate, dp_shard, tp, ep and pp layouts, got cp={par.cp}: the RL "
                "objective scores whole sequences, and context parallel shards them under the LM objective only")
        if par.pp > 1:
            self._check_pipeline()
        if par.ep > 1:  # tp (expert TP on each ep rank's experts) and dp_replicate (replicas of them) compose
            require(par.ep == par.dp_shard, "parallel.ep",
                    f"the RL trainer's experts are split over ep and not FSDP-sharded on the expert dim (ep == "
                    f"dp_shard; with ep < dp_shard each rank would hold a shard of its experts' shard, which the "
                    f"resharding weight sync does not read), got ep={par.ep}, dp_shard={par.dp_shard}")
        require(self.training.mode == "eager" or par.tp == par.ep == 1, "training.mode",
                "graph mode runs data-parallel layouts only; use training.mode='eager' with parallel.tp / ep")
        world, dp = self.trainer_world_size, self.trainer_dp
        require(not (self.workers.resolved_weight_sync(world) == "reshard" and self.workers.generators
                     and self.liveness.on_generator_loss == "continue"), "liveness.on_generator_loss",
                "'continue' drops a lost generator from a broadcast weight sync (workers.weight_sync='gather', one "
                "trainer process, one-process generators); the resharding sync stops the run instead (use 'stop')")
        if world > 1:
            require(self.workers.generators >= 1, "parallel.dp_shard" if dp > 1 else "parallel.pp" if par.pp > 1
                    else "parallel.tp", "colocated generation (workers.generators=0) runs on one unsharded trainer "
                    "process; give generator processes or set dp_shard=dp_replicate=tp=pp=1")
            batch = self.task.groups_per_step * self.rollout.group_size
            require(batch % dp == 0, "task.groups_per_step",
                    f"a step's {batch} episodes (groups_per_step x group_size) must split evenly over the "
                    f"{dp} data-parallel trainer ranks")

    def _check_pipeline(self) -> None:
        """pp > 1 (with any of the trainer's other layouts): the policy loss runs on the schedule's last stage
        (lockstep.rl.objective); what it does not cover."""
        par = self.parallel
        require(getattr(self.model, "vision", None) is None, "parallel.pp",
                f"model family {self.model.family!r} has a vision tower, and pipeline stages are cut from a text "
                "Transformer only (its own forward with images is not split), as in pretraining")
        require(self.training.mode == "eager", "training.mode", "graph mode does not capture a pipeline schedule; use "
                "training.mode='eager' with parallel.pp")
        from lockstep.parallel.pipeline import stages_per_rank, validate_pipeline

        n_mb = par.pp_microbatches or par.pp * stages_per_rank(par.pp_schedule)
        share = self.task.groups_per_step * self.rollout.group_size // max(1, self.trainer_dp)
        micro = self.training.micro_batch_size or share
        try:
            validate_pipeline(par.pp_schedule, par.pp, n_mb, n_layers=self.model.n_layers)
        except ValueError as err:
            raise ConfigError("parallel." + str(err).replace("n_microbatches:", "pp_microbatches:", 1)) from None
        require(not self.sft.steps or self.sft.batch_size % n_mb == 0, "sft.batch_size",
                f"the SFT warm-up's batch ({self.sft.batch_size}) is split into the pipeline's {n_mb} micro-batches of "
                "equal size; make it a multiple")
        require(micro % n_mb == 0 and share % micro == 0, "parallel.pp_microbatches",
                f"each learner micro-batch ({micro} episodes: training.micro_batch_size, or a data-parallel rank's "
                f"share of {share}) is split into {n_mb} pipeline micro-batches of equal size; make it a multiple")

    def _check_seed_ranges(self) -> None:
        t = self.task
        ranges = {"train": (t.train_seed_offset, t.train_seed_offset + self.steps * t.groups_per_step),
                  "sft": (t.sft_seed_offset, t.sft_seed_offset + self.sft.steps * self.sft.batch_size),
                  "eval": (t.eval_seed_offset, t.eval_seed_offset + t.eval_tasks)}
        used = {k: v for k, v in ranges.items() if v[1] > v[0] and (k != "eval" or t.eval_every)}
        names = sorted(used, key=lambda k: used[k][0])
        for a, b in zip(names, names[1:]):
            require(used[a][1] <= used[b][0], f"task.{b}_seed_offset",
                    f"{b} task seeds [{used[b][0]}, {used[b][1]}) overlap the {a} seeds "
                    f"[{used[a][0]}, {used[a][1]}); move one of the offsets")
        env_config = t.environment_config()
        size = getattr(env_config, "size", None)
        if getattr(env_config, "source", None) == "arithmetic":
            size = None  # generated problems: every seed is a new problem
        if size is not None and used:
            top = max(v[1] for v in used.values())
            require(top <= size, "task.options.size",
                    f"the dataset has {size} entries (task seed % size), but task seeds reach {top}: "
                    f"held-out tasks would repeat training ones; raise size or lower the offsets")
