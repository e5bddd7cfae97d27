"""Qwen3.5 <-> Hugging Face checkpoints: the text model (``qwen3_5_text`` / ``qwen3_5_moe_text``) and the
full image-text model (``qwen3_5`` / ``qwen3_5_moe``, ``Qwen3_5[Moe]ForConditionalGeneration``).

The decoder's tensors and config are the hybrid adapter's (:mod:`lockstep.models.qwen3_next.hf`, under
``model.language_model.``). A multimodal ``config.json`` gives a :class:`Qwen3_5VLConfig`: its
``vision_config`` the tower (Qwen3-VL's without DeepStack; ``model.visual.X`` <-> ``visual.X``, the
patch embedding's Conv3d weight held flat, as :mod:`lockstep.models.qwen3_vl.hf` converts it) and
``text_config.rope_parameters.mrope_section`` the mRoPE sections. Round trips are bitwise.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.mrope import PartialMRopeConfig
from lockstep.models.qwen3_5.config import QWEN35_TOKENS, Qwen3_5VLConfig, with_vision
from lockstep.models.qwen3_next.config import Qwen3NextTransformerConfig
from lockstep.models.qwen3_next.hf import HybridHFAdapter
from lockstep.models.qwen3_vl.hf import split_vision_state, vision_from_hf, vision_state_to_hf, vision_to_hf

_TOKEN_FIELDS = tuple(QWEN35_TOKENS)


class Qwen3_5Adapter(HybridHFAdapter):
    """``HFAdapter`` of the qwen3_5 family: text checkpoints as the hybrid adapter reads them, image-text
    checkpoints with their vision tower and mRoPE."""

    def __init__(self) -> None:
        super().__init__("qwen3_5")

    # ---- config -------------------------------------------------------------------------------

    def config_from_hf(self, hf_config: dict[str, Any]) -> Qwen3NextTransformerConfig:
        text = super().config_from_hf(hf_config)
        vision = hf_config.get("vision_config")
        if not text.hf_multimodal or vision is None:
            return text
        if not isinstance(vision, dict):
            raise ConfigError("config.json vision_config: must be an object")
        out_dim = vision.get("out_hidden_size", 3584)
        if out_dim != text.dim:
            raise ConfigError(f"config.json vision_config.out_hidden_size={out_dim} must equal text_config.hidden_size="
                              f"{text.dim}")
        params = hf_config["text_config"].get("rope_parameters") or {}
        tokens = {name: hf_config.get(name, default) for name, default in QWEN35_TOKENS.items()}
        return with_vision(text, vision=vision_from_hf(vision, deepstack=False),
                           mrope_section=params.get("mrope_section", [11, 11, 10]), **tokens)

    def config_to_hf(self, config: Qwen3NextTransformerConfig) -> dict[str, Any]:
        out = super().config_to_hf(config)
        if not isinstance(config, Qwen3_5VLConfig):
            return out
        if not isinstance(config.rope, PartialMRopeConfig):
            raise ConfigError("model.rope: a Qwen3.5 image-text model needs PartialMRopeConfig (mRoPE sections)")
        out["text_config"]["rope_parameters"].update(mrope_section=list(config.rope.mrope_section),
                                                     mrope_interleaved=True)
        out["vision_config"] = vision_to_hf(config.vision, model_type="qwen3_5_vision", out_dim=config.dim,
                                            init_std=config.init_std, deepstack=False)
        out.update({name: getattr(config, name) for name in _TOKEN_FIELDS})
        return out

    # ---- state dict ---------------------------------------------------------------------------

    def state_from_hf(self, hf_state: dict[str, torch.Tensor], config: Qwen3NextTransformerConfig
                      ) -> dict[str, torch.Tensor]:
        if not isinstance(config, Qwen3_5VLConfig):
            return super().state_from_hf(hf_state, config)  # a text model: the tower's tensors are skipped
        vision, rest = split_vision_state(hf_state)
        return {**vision, **super().state_from_hf(rest, config)}

    def state_to_hf(self, state: dict[str, torch.Tensor], config: Qwen3NextTransformerConfig,
                    fused_experts: bool = False) -> dict[str, torch.Tensor]:
        if not isinstance(config, Qwen3_5VLConfig):
            return super().state_to_hf(state, config, fused_experts)
        vision, rest = vision_state_to_hf(state, config.vision)
        return {**vision, **super().state_to_hf(rest, config, fused_experts)}


ADAPTER = Qwen3_5Adapter()
