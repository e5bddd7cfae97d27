"""The Kimi K2.5 model: the DeepSeek-V3 decoder plus MoonViT.

``forward(tokens, positions=None, pixel_values=None, grid_thw=None)``: without images it is the text
decoder. With images, ``tokens`` hold ``h*w/merge**2`` placeholders per image (``config.image_token_id``,
images in order over the batch); MoonViT encodes ``pixel_values`` (patches in raster order, as
transformers' Kimi-K2.5 processor writes them) and the decoder takes the embeddings from outside through
``Transformer.trunk(visual=...)``: the block code is DeepSeek-V3's own.
"""

from __future__ import annotations

import torch

from lockstep.models.common.vision import VisualInputs
from lockstep.models.deepseek_v3.model import DeepSeekV3Transformer


class KimiK25Model(DeepSeekV3Transformer):
    """Tokens (+ images) -> logits; ``visual`` is MoonViT with its projector (HF ``vision_tower`` and
    ``mm_projector``)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.visual = config.vision.build(out_dim=config.dim)
        #: set by sequence parallelism (lockstep.parallel.visual): the whole sequence's visual inputs ->
        #: those of this rank's sequence shard
        self.shard_visual = None

    def visual_inputs(self, tokens: torch.Tensor, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisualInputs:
        """Encode the images once; what ``trunk(visual=...)`` takes (also for a generation prefill)."""
        visual = VisualInputs(tokens == self.config.image_token_id, self.visual(pixel_values, grid_thw))
        return visual if self.shard_visual is None else self.shard_visual(visual)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        if (pixel_values is None) != (grid_thw is None):
            raise ValueError("pixel_values and grid_thw go together (both or neither)")
        visual = None if pixel_values is None else self.visual_inputs(tokens, pixel_values, grid_thw)
        return self.output(self.trunk(tokens, positions, visual=visual)[2])


@torch.no_grad()
def greedy_generate(model: KimiK25Model, tokens: torch.Tensor, pixel_values: torch.Tensor | None = None,
                    grid_thw: torch.Tensor | None = None, max_new_tokens: int = 16) -> torch.Tensor:
    """Greedy continuation ``[B, T + max_new_tokens]`` by full recomputation (a reference, not the engine):
    the images are encoded once; positions are plain ``0..T+k``."""
    features = None if pixel_values is None else model.visual(pixel_values, grid_thw)
    for _ in range(max_new_tokens):
        visual = None if features is None else VisualInputs(tokens == model.config.image_token_id, features)
        logits = model.output(model.trunk(tokens, None, visual=visual)[2][:, -1])
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens
