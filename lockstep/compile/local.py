"""``local_compile``: named regions of model and ops code, compiled alone when the config enables them.

(Skeleton of the registry; the decorator and compilation land with issue #18's local_compile work.)
"""

from __future__ import annotations

from lockstep.config.base import ConfigError

#: region name -> whether it is batch-invariant (may be enabled under numerics.batch_invariant)
_REGIONS: dict[str, bool] = {}


def check_region_names(names: list[str], field: str) -> None:
    """Raise a ConfigError naming ``field`` for a name that is no declared region."""
    for name in names:
        if name not in _REGIONS:
            raise ConfigError(f"{field}: unknown compile region {name!r}; known regions: {sorted(_REGIONS)}")
