"""The ``compile`` section of a run's config: which named regions and which modules are compiled."""

from __future__ import annotations

import dataclasses

from lockstep.compile.local import BACKENDS, check_batch_invariant, check_region_names
from lockstep.config.base import Config, ConfigError, require_choice


@dataclasses.dataclass(kw_only=True)
class CompileConfig(Config):
    """What ``torch.compile`` touches; everything else runs eager."""

    #: named regions to compile alone (fullgraph), e.g. ["rmsnorm", "swiglu"]; unknown names are errors
    regions: list[str] = dataclasses.field(default_factory=list)
    #: module-path globs of blocks compiled whole (one compiled code object shared by every match), e.g. ["layers.*"]
    modules: list[str] = dataclasses.field(default_factory=list)
    #: torch.compile backend: "inductor" (generated kernels) or "aot_eager" (same kernels as eager: bitwise)
    backend: str = "inductor"

    def validate(self, path: str = "compile") -> None:
        require_choice(self.backend, list(BACKENDS), f"{path}.backend")
        check_region_names(self.regions, f"{path}.regions")

    def check_batch_invariant(self, batch_invariant: bool, path: str = "compile") -> None:
        """Refuse what would break ``numerics.batch_invariant``: regions not declared batch-invariant,
        and whole-block compilation (it re-tiles the blocks' matmuls and reductions)."""
        check_batch_invariant(self.regions, batch_invariant, f"{path}.regions")
        if batch_invariant and self.modules:
            raise ConfigError(
                f"{path}.modules: whole-block compilation re-tiles the blocks' matmuls and reductions, whose "
                f"order numerics.batch_invariant=true fixes; set {path}.modules=[] or numerics.batch_invariant=false")
