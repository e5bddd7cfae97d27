"""``CheckpointConfig``: when and where a run checkpoints, and how."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lockstep.config.base import Config, require, require_choice


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig(Config):
    """Periodic full-state checkpoints (model, optimizer, RNG, data position, recipe)."""

    #: save every N steps and at the end (0 = never)
    every: int = 0
    #: keep the newest K complete checkpoints (0 = keep all)
    keep: int = 3
    #: where: a directory, or s3://BUCKET/PREFIX; empty = <run_dir>/checkpoints
    storage: str = ""
    #: S3 endpoint for s3:// storage (e.g. a MinIO/moto URL); empty = AWS default or $AWS_ENDPOINT_URL
    endpoint_url: str = ""
    #: "process": stage, then a background process writes; "sync": write before save() returns
    mode: str = "process"
    #: largest safetensors shard file per rank, in MB
    max_file_mb: int = 1024
    #: rank 0 publishes a checkpoint only after every rank's part: give up after this many seconds
    commit_timeout_s: float = 600.0
    #: with --resume: continue from this step's checkpoint (0 = the newest one that verifies); newer
    #: checkpoints are moved into <storage>/set-aside/, not deleted (`lockstep train --resume-from STEP`)
    resume_from: int = 0

    def validate(self, path: str = "checkpoint") -> None:
        require(self.every >= 0, f"{path}.every", f"must be >= 0, got {self.every}")
        require(self.keep >= 0, f"{path}.keep", f"must be >= 0, got {self.keep}")
        require_choice(self.mode, ["process", "sync"], f"{path}.mode")
        require(self.max_file_mb > 0, f"{path}.max_file_mb", f"must be > 0, got {self.max_file_mb}")
        require(self.resume_from >= 0, f"{path}.resume_from", f"must be a step >= 1 (or 0: the newest), "
                f"got {self.resume_from}")
        require(self.commit_timeout_s > 0, f"{path}.commit_timeout_s", f"must be > 0, got {self.commit_timeout_s}")
        require(self.storage == "" or self.storage.startswith("s3://") or "://" not in self.storage,
                f"{path}.storage", f"must be a directory or s3://BUCKET/PREFIX, got {self.storage!r}")

    def location(self, run_dir: Path) -> str:
        return self.storage or str(run_dir / "checkpoints")

    def build(self, run_dir: Path, *, rank: int = 0, world_size: int = 1, group=None):
        """The run's Checkpointer (every rank builds one; rank 0 cleans up interrupted saves)."""
        from lockstep.checkpoint.checkpointer import Checkpointer
        from lockstep.checkpoint.storage import storage_from_uri

        storage = storage_from_uri(self.location(run_dir), endpoint_url=self.endpoint_url)
        return Checkpointer(storage, rank=rank, world_size=world_size, keep=self.keep, mode=self.mode,
                            max_file_bytes=self.max_file_mb << 20, commit_timeout_s=self.commit_timeout_s,
                            group=group)
