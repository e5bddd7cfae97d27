"""``LowPrecisionConfig``: which layers of a run train in FP8 / MXFP8, and the checks that refuse
combinations the converters do not support (batch-invariant mode, graph mode, tensor/expert parallel)."""

from __future__ import annotations

import dataclasses

from lockstep.config.base import Config, ConfigError, require, require_choice
from lockstep.convert.quantize import FORMATS

#: "none" (no conversion) or one of the low-precision formats
FORMAT_CHOICES = ("none", *FORMATS)
EMULATE_CHOICES = ("auto", "always")
#: every dim of a converted GEMM must be a multiple of this (fp8 GEMM kernels: 16; MX: the 32-block)
ALIGNMENT = {"fp8_tensorwise": 16, "fp8_rowwise": 16, "mxfp8": 32}


@dataclasses.dataclass(kw_only=True)
class LowPrecisionConfig(Config):
    """Low-precision training GEMMs (torchao Float8 / MXFP8); weights, optimizer state and checkpoints
    stay in full precision. See docs/numerics.md ("Low-precision training")."""

    #: "none", "fp8_tensorwise", "fp8_rowwise" or "mxfp8"
    format: str = "none"
    #: module-path globs of the layers to consider (nn.Linear and MoE grouped experts)
    include: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    #: module-path globs to keep in high precision (each must match a considered layer)
    exclude: list[str] = dataclasses.field(default_factory=list)
    #: convert the output head too (off by default: the logits' precision drives the loss)
    convert_output: bool = False
    #: convert MoE routers (off by default: routing decisions are discrete and precision-sensitive)
    convert_router: bool = False
    #: convert the MoE grouped experts (lockstep's emulated low-precision GEMMs)
    experts: bool = True
    #: layers with fewer weight elements than this stay in high precision
    min_elements: int = 1024
    #: "auto" (emulate unless a CUDA device has the format's kernels) or "always"
    emulate: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.format != "none"

    def validate(self, path: str = "low_precision") -> None:
        require_choice(self.format, FORMAT_CHOICES, f"{path}.format")
        require_choice(self.emulate, EMULATE_CHOICES, f"{path}.emulate")
        require(self.min_elements >= 0, f"{path}.min_elements", f"must be >= 0, got {self.min_elements}")
        for name in ("include", "exclude"):
            for glob in getattr(self, name):
                require(isinstance(glob, str) and bool(glob), f"{path}.{name}", f"globs must be non-empty strings, got {glob!r}")

    def check_run(self, *, batch_invariant: bool, mode: str, tp: int, ep: int, path: str = "low_precision") -> None:
        """Refuse the run settings the converters cannot honour, naming both fields."""
        if not self.enabled:
            return
        if batch_invariant:
            raise ConfigError(
                f"{path}.format: {self.format!r} cannot run with numerics.batch_invariant=true: batch-invariant "
                "mode needs the trainer and the generator to compute alike, and lockstep's generator has no "
                f"low-precision GEMMs; set {path}.format=none or numerics.batch_invariant=false")
        if mode != "eager":
            raise ConfigError(f"{path}.format: converted layers run in training.mode=eager only (got {mode!r})")
        if tp > 1 or ep > 1:
            raise ConfigError(f"{path}.format: converted layers are not sharded by tensor or expert parallelism "
                              f"yet (parallel.tp={tp}, parallel.ep={ep}); use data/pipeline parallelism")
