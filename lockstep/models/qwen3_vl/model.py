"""The Qwen3-VL model: the shared decoder (:class:`Transformer`) plus a vision tower.

``forward(tokens, positions=None, pixel_values=None, grid_thw=None)``: without images it is the text
decoder (mRoPE of text positions is plain RoPE). With images, ``tokens`` hold ``t*h*w/merge**2``
image placeholders per image (``config.image_token_id``, images in order over the batch), the tower
encodes ``pixel_values`` (:mod:`lockstep.data.images`), and the decoder takes the merged embeddings,
the DeepStack features and the ``[3, B, T]`` mRoPE positions from outside through
``Transformer.trunk(visual=...)``: the block code is the text model's own.

The class is generic over the decoder: Qwen3.5's image-text config (:mod:`lockstep.models.qwen3_5.config`,
the Gated DeltaNet hybrid, no DeepStack) builds it too.
"""

from __future__ import annotations

import torch

from lockstep.models.common.mrope import mrope_positions
from lockstep.models.common.transformer import Transformer
from lockstep.models.common.vision import VisualInputs


class Qwen3VLModel(Transformer):
    """Tokens (+ images) -> logits; ``visual`` is the vision tower (HF ``model.visual``)."""

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

    def image_positions(self, tokens: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([3, B, T] mRoPE positions, [B] decode deltas)`` of ``tokens`` holding the images of ``grid_thw``."""
        return mrope_positions(tokens, grid_thw, self.config.image_token_id, self.config.vision.spatial_merge_size)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        if (pixel_values is None) != (grid_thw is None):
            raise ValueError("pixel_values and grid_thw go together (both or neither)")
        visual = None
        if pixel_values is not None:
            visual = self.visual_inputs(tokens, pixel_values, grid_thw)
            if positions is None:
                positions = self.image_positions(tokens, grid_thw)[0]
        return self.output(self.trunk(tokens, positions, visual=visual)[2])


@torch.no_grad()
def greedy_generate(model: Qwen3VLModel, tokens: torch.Tensor, pixel_values: torch.Tensor | None = None,
                    grid_thw: torch.Tensor | None = None, max_new_tokens: int = 16) -> torch.Tensor:
    """Greedy continuation ``[B, T + max_new_tokens]`` by full recomputation (a reference, not the engine):
    the images are encoded once; generated tokens continue the mRoPE positions at ``T + k + delta`` on all
    three axes, as transformers' ``generate`` does."""
    visual = features = None
    if pixel_values is not None:
        features = model.visual(pixel_values, grid_thw)
        positions, deltas = model.image_positions(tokens, grid_thw)
    else:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(3, *tokens.shape)
        deltas = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
    for _ in range(max_new_tokens):
        if features is not None:
            visual = VisualInputs(tokens == model.config.image_token_id, features)
        logits = model.output(model.trunk(tokens, positions, visual=visual)[2][:, -1])
        step = tokens.shape[1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        positions = torch.cat([positions, (step + deltas).view(1, -1, 1).expand(3, -1, 1)], dim=2)
    return tokens
