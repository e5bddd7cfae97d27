"""Typed configuration: the Config base, glob overrides, named transforms and component kinds."""

from lockstep.config.base import Config, ConfigError, set_by_path, to_dict  # noqa: F401
from lockstep.config.overrides import ComponentOverride, apply_overrides  # noqa: F401
