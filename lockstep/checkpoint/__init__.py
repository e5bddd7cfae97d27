"""Async, sharded, resharding checkpoints of the full training state (see docs/checkpointing.md).

``Checkpointer`` stages state into a reusable shared buffer and a background process writes
safetensors shards + a JSON index; ``load`` fills any parallel layout's tensors from any other's.
"""

import importlib

_EXPORTS = {
    "Checkpointer": "checkpointer", "SaveStats": "checkpointer", "latest_step": "checkpointer",
    "CheckpointConfig": "config", "CheckpointError": "format", "Slot": "layout",
    "LocalStorage": "storage", "S3Storage": "storage", "Storage": "storage", "StorageError": "storage",
    "storage_from_uri": "storage",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # Lazy: the background writer imports lockstep.checkpoint.writer without pulling in torch.
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"lockstep.checkpoint.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'lockstep.checkpoint' has no attribute {name!r}")
