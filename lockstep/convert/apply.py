"""Convert a built model's layers to low-precision training GEMMs, and say which ones.

:func:`convert_model` walks the ``nn.Linear`` layers and MoE grouped experts, chooses with
:func:`plan_conversion` (include/exclude globs, head and routers, alignment, size), swaps the chosen
ones in place (:mod:`lockstep.convert.linear`, :mod:`lockstep.convert.experts`) and returns a
:class:`ConversionReport` for the console and the run manifest. Parameters and their names do not
change. Call it on the unsplit model, before parallelism wraps it.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
from torch import nn

from lockstep.config.overrides import match_module_globs
from lockstep.convert.config import ALIGNMENT, LowPrecisionConfig
from lockstep.models.common.moe import GroupedExperts

#: the minimum CUDA capability of each format's real kernels (below it, and on CPU: emulation)
KERNEL_CAPABILITY = {"fp8_tensorwise": (8, 9), "fp8_rowwise": (8, 9), "mxfp8": (10, 0)}


@dataclasses.dataclass
class ConversionReport:
    """What a conversion did: converted layer path -> format, kept layer path -> reason."""

    format: str
    emulated: bool
    converted: dict[str, str] = dataclasses.field(default_factory=dict)
    kept: dict[str, str] = dataclasses.field(default_factory=dict)

    def manifest(self) -> dict:
        """The manifest's ``low_precision`` section."""
        return {"format": self.format, "emulated": self.emulated, "numerics_changing": True,
                "layers": dict(self.converted), "kept_high_precision": dict(self.kept)}

    def summary(self) -> str:
        how = "emulated in torch" if self.emulated else "native kernels"
        return (f"low_precision: {len(self.converted)} layers in {self.format} ({how}), "
                f"{len(self.kept)} kept in high precision")


def _candidates(model: nn.Module) -> dict[str, nn.Module]:
    out = {}
    for path, module in model.named_modules():
        if hasattr(module, "low_precision_format"):  # converted already
            continue
        if isinstance(module, nn.Linear) or type(module) is GroupedExperts:
            out[path] = module
    return out


def _is_router(model: nn.Module, path: str) -> bool:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    return name == "gate" and isinstance(getattr(parent, "experts", None), GroupedExperts)


def _gemm_dims(module: nn.Module) -> tuple[int, ...]:
    if isinstance(module, GroupedExperts):
        return module.dim, module.hidden_dim
    return module.in_features, module.out_features


def _weight_elements(module: nn.Module) -> int:
    return module.w1[0].numel() if isinstance(module, GroupedExperts) else module.weight.numel()


def plan_conversion(model: nn.Module, config: LowPrecisionConfig, field: str = "low_precision") -> dict[str, str | None]:
    """Every candidate layer's path -> None (convert it) or why it stays in high precision."""
    candidates = _candidates(model)
    included = {p for ps in match_module_globs(candidates, config.include, f"{field}.include").values() for p in ps}
    excluded = {p for ps in match_module_globs(candidates, config.exclude, f"{field}.exclude").values() for p in ps}
    align = ALIGNMENT[config.format]
    head = getattr(model, "output", None)
    plan: dict[str, str | None] = {}
    for path, module in candidates.items():
        if path not in included:
            reason = f"not matched by {field}.include"
        elif path in excluded:
            reason = f"{field}.exclude"
        elif module is head and not config.convert_output:
            reason = "output head"
        elif _is_router(model, path) and not config.convert_router:
            reason = "MoE router"
        elif isinstance(module, GroupedExperts) and not config.experts:
            reason = f"{field}.experts=false"
        elif any(d % align for d in _gemm_dims(module)):
            reason = f"dims {_gemm_dims(module)} not multiples of {align}"
        elif _weight_elements(module) < config.min_elements:
            reason = f"{_weight_elements(module)} weight elements < {field}.min_elements={config.min_elements}"
        else:
            reason = None
        plan[path] = reason
    return plan


def uses_emulation(config: LowPrecisionConfig, device: torch.device) -> bool:
    """Whether the linears' GEMMs are emulated on ``device`` (the experts' always are)."""
    if config.emulate == "always" or device.type != "cuda" or not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device) < KERNEL_CAPABILITY[config.format]


def convert_model(model: nn.Module, config: LowPrecisionConfig, device: torch.device | str = "cpu") -> ConversionReport:
    """Convert ``model``'s chosen layers in place for ``config.format``; see the module docstring."""
    from lockstep.convert.experts import to_low_precision_experts
    from lockstep.convert.linear import to_float8_linear, to_mxfp8_linear

    device = torch.device(device)
    emulate = uses_emulation(config, device)
    has_experts = False
    report = ConversionReport(config.format, emulated=emulate)
    for path, reason in plan_conversion(model, config).items():
        if reason is not None:
            report.kept[path] = reason
            continue
        module = model.get_submodule(path)
        if isinstance(module, GroupedExperts):
            to_low_precision_experts(module, config.format)
            has_experts = True
        elif config.format == "mxfp8":
            to_mxfp8_linear(module, emulate)
        else:
            new = to_float8_linear(module, config.format.removeprefix("fp8_"), emulate)
            parent_path, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent_path) if parent_path else model, name, new)
        report.converted[path] = config.format
    report.emulated = emulate or has_experts
    return report
