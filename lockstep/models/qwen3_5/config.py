"""The Qwen3.5 image-text model config: the Qwen3.5 hybrid decoder (Gated DeltaNet + gated attention,
dense or MoE; :mod:`lockstep.models.qwen3_next.config`) with interleaved mRoPE over the rotated part of
each full-attention head, plus the Qwen3-VL vision tower without DeepStack.

Only the full-attention blocks take positions (the tables of :class:`PartialMRopeConfig`); the Gated
DeltaNet blocks ignore them, as in transformers' ``Qwen3_5Model``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lockstep.models.common.mrope import PartialMRopeConfig
from lockstep.models.common.rope import RopeConfig
from lockstep.models.common.vision import VisionConfig, check_vision_language
from lockstep.models.qwen3_next.config import Qwen3NextTransformerConfig, hybrid_config

if TYPE_CHECKING:
    from lockstep.models.qwen3_vl.model import Qwen3VLModel

#: Qwen3.5's special tokens (transformers' ``Qwen3_5Config`` defaults)
QWEN35_TOKENS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                     vision_end_token_id=248054)


@dataclasses.dataclass(kw_only=True)
class Qwen3_5VLConfig(Qwen3NextTransformerConfig):
    """Qwen3.5 with images: the hybrid decoder's fields, ``vision`` tower and special tokens."""

    family: str = "qwen3_5"
    rope: RopeConfig = dataclasses.field(default_factory=lambda: PartialMRopeConfig(
        theta=10_000_000.0, partial_rotary_factor=0.25, mrope_section=[11, 11, 10]))
    #: the vision tower (its output width is ``dim``); Qwen3.5 has no DeepStack
    vision: VisionConfig = dataclasses.field(default_factory=lambda: VisionConfig(deepstack_layers=[]))
    #: placeholder token of one merged image patch
    image_token_id: int = QWEN35_TOKENS["image_token_id"]
    #: placeholder token of one merged video patch (videos are not implemented here)
    video_token_id: int = QWEN35_TOKENS["video_token_id"]
    #: token before an image's placeholders
    vision_start_token_id: int = QWEN35_TOKENS["vision_start_token_id"]
    #: token after an image's placeholders
    vision_end_token_id: int = QWEN35_TOKENS["vision_end_token_id"]
    hf_multimodal: bool = True

    def validate(self, path: str = "model") -> None:
        check_vision_language(self, path)
        super().validate(path)

    def build(self) -> "Qwen3VLModel":
        # the Qwen3-VL model class is generic over the decoder: tower, merged embeddings, mRoPE positions
        from lockstep.models.qwen3_vl.model import Qwen3VLModel

        return Qwen3VLModel(self)


def qwen3_5_vl_config(flavor: str, *, vision: VisionConfig, mrope_section: list[int], tokens: dict[str, int],
                      **text) -> Qwen3_5VLConfig:
    """A Qwen3.5 image-text config: ``text`` as :func:`hybrid_config` takes it (family qwen3_5, split
    projections), plus the tower, mRoPE sections and special tokens."""
    base = hybrid_config("qwen3_5", flavor, projection="split", **text)
    return with_vision(base, vision=vision, mrope_section=mrope_section, **tokens)


def with_vision(text: Qwen3NextTransformerConfig, *, vision: VisionConfig, mrope_section: list[int],
                **fields) -> Qwen3_5VLConfig:
    """``text``'s decoder made image-text: its partial RoPE becomes mRoPE with ``mrope_section`` (same
    theta and rotated fraction), ``vision`` the tower, ``fields`` the rest (token ids, flavor)."""
    rope = PartialMRopeConfig(theta=text.rope.theta, partial_rotary_factor=text.rope.partial_rotary_factor,
                              mrope_section=list(mrope_section))
    values = {f.name: getattr(text, f.name) for f in dataclasses.fields(text) if f.init}
    return Qwen3_5VLConfig(**{**values, "hf_multimodal": True, "rope": rope, "vision": vision, **fields})
