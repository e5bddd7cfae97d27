"""Async, sharded, resharding checkpoints of the full training state (see docs/checkpointing.md).

``Checkpointer`` stages state into a reusable shared buffer and a background process writes
safetensors shards + a JSON index; ``load`` fills any parallel layout's tensors from any other's.
"""

from lockstep.checkpoint.checkpointer import Checkpointer, SaveStats, latest_step
from lockstep.checkpoint.config import CheckpointConfig
from lockstep.checkpoint.format import CheckpointError
from lockstep.checkpoint.layout import Slot
from lockstep.checkpoint.storage import LocalStorage, S3Storage, Storage, StorageError, storage_from_uri

__all__ = ["CheckpointConfig", "CheckpointError", "Checkpointer", "LocalStorage", "S3Storage", "SaveStats", "Slot",
           "Storage", "StorageError", "latest_step", "storage_from_uri"]
