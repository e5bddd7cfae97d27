"""The contract between a model family and Hugging Face checkpoints.

Each family that interoperates provides one ``HFAdapter`` (in ``models/<family>/hf.py``) and sets it
as ``ModelSpec.hf_adapter``. ``lockstep.models.hf`` (load_hf / save_hf) does the file work: reading
``config.json`` and (sharded) safetensors, error reporting; the adapter only translates names,
layouts and config fields.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from lockstep.models.common.transformer import TransformerConfig


class HFAdapter(Protocol):
    def config_from_hf(self, hf_config: dict[str, Any]) -> TransformerConfig:
        """A lockstep config equal in architecture to the HF ``config.json`` dict."""

    def config_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        """A ``config.json`` dict transformers loads as the same architecture."""

    def state_from_hf(self, hf_state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
        """HF tensor names/layouts -> lockstep state dict (raise listing unknown names)."""

    def state_to_hf(self, state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
        """lockstep state dict -> HF tensor names/layouts."""
