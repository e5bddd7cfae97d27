"""The run manifest's common sections, assembled in one place for every run kind.

``run_manifest`` fills ``recipe``, ``model``, ``numerics``, ``kernels``, ``determinism``,
``parallel``, ``checkpoint``, ``resumed`` and ``result`` (None until the run ends) on top of what
:class:`~lockstep.observe.RunManifest` always records (versions, hardware, checks); a workload passes
its own sections (pretraining: data, peak FLOP/s; RL: workers, environment) as keywords.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lockstep import numerics
from lockstep.config.base import to_dict
from lockstep.observe import RunManifest
from lockstep.parallel.tested_layouts import trains_on_images

#: sections every run's manifest.json has (besides versions, hardware, checks, started_at)
COMMON_SECTIONS = ("recipe", "model", "numerics", "kernels", "determinism", "parallel", "checkpoint", "resumed",
                   "result")


def model_kernels(model: torch.nn.Module) -> dict[str, Any]:
    """The attention backends, linear-attention kernels (hybrid models only) and MoE routing modes of
    an (unsplit) model."""
    mixers = [layer.attention for layer in model.layers.values()]
    kernels = {
        "attention": sorted({m.backend_name for m in mixers if hasattr(m, "backend_name")}),
        # forced_balanced ignores the router: its throughput is not learned routing's
        "moe_routing": sorted({m.routing_mode for m in model.modules() if hasattr(m, "routing_mode")}) or None,
    }
    linear = sorted({m.kernel_name for m in mixers if hasattr(m, "kernel_name")})  # Gated DeltaNet layers
    return {**kernels, "linear_attention": linear} if linear else kernels


def run_manifest(run_dir: Path, config, *, model: dict, kernels: dict, runtime, checkpoint=None,
                 resumed: dict | None = None, numerics_extra: dict | None = None, **sections: Any) -> RunManifest:
    """The manifest of a run of ``config`` (a RunConfig), written once; ``runtime`` is its
    ParallelRuntime, ``checkpoint`` its CheckpointPolicy (None when it saves none)."""
    manifest = RunManifest(run_dir, recipe=to_dict(config), model=model)
    parallel = getattr(config, "parallel", None)
    manifest.update(
        kernels={**kernels, "device": str(runtime.device)},
        numerics={**numerics.thread_settings(), **(numerics_extra or {})},
        determinism={
            "seed": config.seed,
            "threads": torch.get_num_threads(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "note": "same recipe, seed, machine and thread count give bitwise identical losses",
        },
        parallel=runtime.describe(config.model.family, parallel, trains_on_images(config)),
        checkpoint=checkpoint.describe() if checkpoint is not None else None,
        resumed=resumed,
        result=None,
        **sections,
    )
    return manifest
