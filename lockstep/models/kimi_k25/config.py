"""The Kimi K2.5 model config: the DeepSeek-V3 text decoder (Kimi-K2's shape in the release) plus MoonViT.

Text positions are plain 1-D (no mRoPE): image placeholders take ordinary positions, as in transformers.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lockstep.config.base import require
from lockstep.models.common.moonvit import MoonViTConfig
from lockstep.models.deepseek_v3.model import DeepSeekV3Config

if TYPE_CHECKING:
    from lockstep.models.kimi_k25.model import KimiK25Model


@dataclasses.dataclass(kw_only=True)
class KimiK25Config(DeepSeekV3Config):
    """Kimi K2.5: DeepSeek-V3 decoder sizes (the DeepSeekV3Config fields), ``vision`` tower and special tokens."""

    family: str = "kimi_k25"
    #: the MoonViT tower and its projector (output width ``dim``)
    vision: MoonViTConfig = dataclasses.field(default_factory=MoonViTConfig)
    #: placeholder token of one merged image patch
    image_token_id: int = 163605
    #: placeholder token of one merged video patch (videos are not implemented here)
    video_token_id: int = 163840
    #: token before an image's placeholders
    vision_start_token_id: int = 163602
    #: token after an image's placeholders
    vision_end_token_id: int = 163604

    def validate(self, path: str = "model") -> None:
        require(self.n_mtp == 0, f"{path}.n_mtp", f"multi-token prediction with images is not implemented for "
                f"kimi_k25 (transformers has none either), got {self.n_mtp}")
        require(0 <= self.image_token_id < self.vocab_size, f"{path}.image_token_id",
                f"{self.image_token_id} is outside the vocabulary [0, {self.vocab_size})")
        super().validate(path)

    def build(self) -> "KimiK25Model":
        from lockstep.models.kimi_k25.model import KimiK25Model

        return KimiK25Model(self)


def kimi_k25_config(text: DeepSeekV3Config, vision: MoonViTConfig, flavor: str | None = None,
                    **tokens: int) -> KimiK25Config:
    """A Kimi K2.5 config from a DeepSeek-V3 text config (its fields are copied) and a MoonViT config."""
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(DeepSeekV3Config) if f.init}
    fields.update(family="kimi_k25", n_mtp=0, vision=vision, **tokens)
    if flavor is not None:
        fields["flavor"] = flavor
    return KimiK25Config(**fields)
