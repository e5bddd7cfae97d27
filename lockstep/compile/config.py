"""The ``compile`` section of a run's config: which named regions and which modules are compiled."""

from __future__ import annotations

import dataclasses

from lockstep.config.base import Config, require_choice


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
        require_choice(self.backend, ["inductor", "aot_eager"], f"{path}.backend")
        from lockstep.compile.local import check_region_names  # the registry names the known regions

        check_region_names(self.regions, f"{path}.regions")
