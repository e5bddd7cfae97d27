"""The root of a training run's config tree: ``TrainerConfig`` and its training-loop sections."""

from __future__ import annotations

import dataclasses

from lockstep.checkpoint.config import CheckpointConfig
from lockstep.config.base import ALLOW_INF, Config, ConfigError, require, require_choice, require_positive
from lockstep.compile.config import CompileConfig
from lockstep.config.run import RunConfig
from lockstep.convert.config import LowPrecisionConfig
from lockstep.data.config import DataConfig
from lockstep.data.image_mix import check_image_training
from lockstep.graph.config import GraphConfig, check_graph_layout
from lockstep.models.common.sparse_indexer import refuse_batch_invariant
from lockstep.models.common.transformer import TransformerConfig
from lockstep.numerics import NumericsConfig
from lockstep.parallel.checkpointing import ActivationCheckpointConfig
from lockstep.parallel.dims import ParallelConfig
from lockstep.run.config import SinkOutputs, validate_device
from lockstep.run.nonfinite import validate_nonfinite
from lockstep.train.optim import LRScheduleConfig, OptimizerConfig

DTYPES = ["float32", "bfloat16"]
TRAINING_MODES = ["eager", "graph"]


def require_batch_invariant_on_cpu(numerics: NumericsConfig, device: str, device_field: str = "training.device") -> None:
    """Refuse ``numerics.batch_invariant`` when ``device`` (auto|cpu|cuda) resolves to CUDA, naming both
    fields, before any work: its kernels are CPU-only, as the engine's own check says at build time
    (``generate.engine.check_batch_invariant_device``)."""
    if not numerics.batch_invariant:
        return
    from lockstep.parallel.launch import resolve_device

    device_type = resolve_device(device, device_field).type
    if device_type != "cpu":
        raise ConfigError(
            f"numerics.batch_invariant: batch-invariant mode is CPU-only (its kernels fix a row's arithmetic "
            f"order on the CPU; the {device_type} library GEMMs and reductions split sums by the batch shape), "
            f"but {device_field}={device!r} resolves to {device_type}; set {device_field}=cpu, or "
            "numerics.batch_invariant=false")


def check_execution_sections(mode: str, graph: GraphConfig, compile: CompileConfig | None = None, *,
                             parallel: ParallelConfig | None = None,
                             activation_checkpoint: ActivationCheckpointConfig | None = None,
                             batch_invariant: bool = False) -> None:
    """Refuse settings the chosen ``training.mode`` would silently ignore: the ``graph`` section outside
    graph mode, and ``compile`` regions/modules inside it (the captured step is compiled by its own
    ``inductor`` pass, never by eager-mode wrappers)."""
    if mode != "graph" and graph != GraphConfig():
        changed = [f.name for f in dataclasses.fields(graph) if getattr(graph, f.name) != getattr(GraphConfig(), f.name)]
        raise ConfigError(f"graph.{changed[0]}: applies to training.mode=graph only (training.mode={mode!r})")
    if mode == "graph" and parallel is not None:
        check_graph_layout({name: getattr(parallel, name) for name in ("tp", "cp", "pp", "ep")},
                           activation_checkpoint.mode, batch_invariant)
    if mode == "graph" and compile is not None:
        for name in ("regions", "modules"):
            if getattr(compile, name):
                raise ConfigError(
                    f"compile.{name}: has no effect under training.mode=graph (the captured step is one graph; "
                    "compile it with graph.enable=['inductor'], optionally graph.inductor_regions)")


@dataclasses.dataclass(kw_only=True)
class TrainingConfig(Config):
    """Batch shape, precision, clipping and accumulation."""

    #: sequences per micro-batch, summed over data-parallel ranks (each rank takes batch_size / dp)
    batch_size: int = 8
    #: tokens per sequence
    seq_len: int = 256
    #: micro-batches accumulated per optimizer step
    grad_accum: int = 1
    #: clip the global gradient norm to this (0 disables clipping)
    max_grad_norm: float = dataclasses.field(default=1.0, metadata=ALLOW_INF)
    #: compute dtype: "float32", or "bfloat16" (autocast; weights and optimizer stay fp32)
    dtype: str = "float32"
    #: torch intra-op threads; 0 keeps torch's default
    threads: int = 0
    #: how a micro-batch's forward + backward runs: "eager" (autograd) or "graph" (captured once per
    #: shape as one FX graph, rewritten by the ``graph`` section's passes; bitwise equal to eager by default)
    mode: str = "eager"
    #: activation checkpointing per block: mode none/full/selective/regions, and regions' save globs
    activation_checkpoint: ActivationCheckpointConfig = dataclasses.field(default_factory=ActivationCheckpointConfig)
    #: where the model, batches and autocast live: "auto" (CUDA when available), "cpu" or "cuda"
    device: str = "auto"
    #: non-finite loss/grad norm: "stop" (nothing saved from it), "skip_step" (drop the update), "rollback" (newest checkpoint)
    on_nonfinite: str = "stop"
    #: rollbacks allowed per run before on_nonfinite=rollback stops
    max_rollbacks: int = 3

    def validate(self, path: str = "training") -> None:
        require_positive(self.batch_size, f"{path}.batch_size")
        require_positive(self.seq_len, f"{path}.seq_len")
        require_positive(self.grad_accum, f"{path}.grad_accum")
        require(self.max_grad_norm >= 0, f"{path}.max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        require_choice(self.dtype, DTYPES, f"{path}.dtype")
        require(self.threads >= 0, f"{path}.threads", f"must be >= 0, got {self.threads}")
        require_choice(self.mode, TRAINING_MODES, f"{path}.mode")
        require(isinstance(self.activation_checkpoint, ActivationCheckpointConfig), f"{path}.activation_checkpoint",
                f"is a section now: ActivationCheckpointConfig(mode=...), got {self.activation_checkpoint!r} "
                f"(on the command line: --{path}.activation-checkpoint.mode)")
        self.activation_checkpoint.validate(f"{path}.activation_checkpoint")
        require(self.mode == "eager" or self.activation_checkpoint.mode != "regions",
                f"{path}.activation_checkpoint.mode",
                f"'regions' (torch_remat, eager) cannot be captured by {path}.mode=graph; the graph trainer chooses "
                "what to save with its own passes (the graph section)")
        validate_device(self.device, f"{path}.device")
        validate_nonfinite(self.on_nonfinite, self.max_rollbacks, path)


@dataclasses.dataclass(kw_only=True)
class ValidationConfig(Config):
    """Held-out loss during training."""

    #: evaluate every N steps (and at the last step); 0 disables
    every: int = 50
    #: validation batches per evaluation (0 = the whole validation split)
    batches: int = 8

    def validate(self, path: str = "validation") -> None:
        require(self.every >= 0, f"{path}.every", f"must be >= 0, got {self.every}")
        require(self.batches >= 0, f"{path}.batches", f"must be >= 0, got {self.batches}")


@dataclasses.dataclass(kw_only=True)
class OutputConfig(SinkOutputs):
    """What the run prints and writes besides metrics and the manifest (and the sinks' switches)."""

    #: show a progress bar on the console
    progress: bool = True
    #: greedy-sample this many tokens from the trained model at the end (0 disables)
    sample_tokens: int = 64
    #: prompt of that sample
    sample_prompt: str = "ROMEO:"
    #: write the final weights as model.safetensors
    save_weights: bool = True
    #: at start, check the model family against transformers (debug flavor, fp32 logits) and record it in the manifest
    parity_check: bool = True


@dataclasses.dataclass(kw_only=True)
class TrainerConfig(RunConfig):
    """A whole training run: recipe name, model, data, optimizer, schedule and loop settings."""

    #: the model architecture
    model: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
    #: the corpus, tokenizer and loaders
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    #: the optimizer
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    #: the learning-rate schedule
    lr_schedule: LRScheduleConfig = dataclasses.field(default_factory=LRScheduleConfig)
    #: batch, precision and accumulation
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    #: held-out evaluation
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    #: console and output files
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    #: parallel layout across processes (torchrun); all 1 = one process
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    #: periodic full-state checkpoints
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    #: numerics switches (batch-invariant kernels)
    numerics: NumericsConfig = dataclasses.field(default_factory=NumericsConfig)
    #: the captured training step's passes and debugging (training.mode = "graph")
    graph: GraphConfig = dataclasses.field(default_factory=GraphConfig)
    #: selective compilation: named regions and whole blocks
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    #: FP8 / MXFP8 training GEMMs for chosen layers (lockstep.convert; full-precision weights)
    low_precision: LowPrecisionConfig = dataclasses.field(default_factory=LowPrecisionConfig)
    #: names of the model-config transforms that were applied, in order (recorded, not re-applied)
    transforms: list[str] = dataclasses.field(default_factory=list)

    def validate(self, path: str = "") -> None:
        self.validate_run()
        require(
            self.training.seq_len <= self.model.max_seq_len,
            "training.seq_len",
            f"must be <= model.max_seq_len={self.model.max_seq_len}, got {self.training.seq_len}",
        )
        require(
            self.model.vocab_size >= self.data.vocab_size,
            "model.vocab_size",
            f"must be >= data.vocab_size={self.data.vocab_size}, got {self.model.vocab_size}",
        )
        self.model.validate("model")
        self.data.validate("data")
        self.optimizer.validate("optimizer")
        self.lr_schedule.validate("lr_schedule")
        self.training.validate("training")
        self.validation.validate("validation")
        self.output.validate("output")
        self.parallel.validate("parallel")
        self.checkpoint.validate("checkpoint")
        self.numerics.validate("numerics")
        self.graph.validate("graph")
        self.compile.validate("compile")
        self.compile.check_batch_invariant(self.numerics.batch_invariant)  # names both fields
        check_execution_sections(self.training.mode, self.graph, self.compile, parallel=self.parallel,
                                 activation_checkpoint=self.training.activation_checkpoint,
                                 batch_invariant=self.numerics.batch_invariant)
        require_batch_invariant_on_cpu(self.numerics, self.training.device)
        self.low_precision.validate("low_precision")
        self.low_precision.check_run(batch_invariant=self.numerics.batch_invariant, mode=self.training.mode,
                                     tp=self.parallel.tp, ep=self.parallel.ep)
        refuse_batch_invariant(self.model, self.numerics.batch_invariant)
        check_image_training(self.data, self.model, self.parallel, self.training.mode)
        if self.numerics.batch_invariant:
            require(self.parallel.tp == 1 and self.parallel.cp == 1 and self.parallel.pp == 1,
                    "numerics.batch_invariant", "is supported without tensor, context or pipeline parallelism "
                    "(docs/numerics.md); set parallel.tp/cp/pp to 1")
