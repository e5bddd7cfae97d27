"""Model definitions: shared components in ``common/`` and one small wiring file per family."""
