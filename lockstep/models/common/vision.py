"""The Qwen3-VL / Qwen3.5 vision tower, and the visual inputs a decoder takes from it.

``VisionTower(pixel_values [P, C*tp*p*p], grid_thw [N, 3]) -> VisionFeatures``:

1. patch embedding: one linear map of each flattened ``(C, tp, p, p)`` patch (transformers holds it as a
   Conv3d whose kernel equals its stride -- the same function; the HF adapter reshapes the weight);
2. learned position embeddings on a square ``side x side`` grid, bilinearly interpolated
   (align_corners) to each image's ``h x w`` patch grid;
3. ``depth`` pre-norm ViT blocks (LayerNorm, bidirectional attention within each image frame, 2-D
   RoPE: half the rotary frequencies follow the patch row, half the column; GELU-tanh MLP);
4. a 2x2 patch merger (LayerNorm, then the four neighbouring patches concatenated, MLP to the
   decoder width), and one DeepStack merger per layer in ``deepstack_layers`` (the same merge on that
   block's output, LayerNorm after the concatenation).

Qwen3.5's tower is this one without DeepStack (``deepstack_layers=[]``: no DeepStack mergers, nothing
added to the decoder after its blocks).

Patches arrive in merge-block order (each 2x2 block's four patches adjacent), as the processor
(:mod:`lockstep.data.images`) writes them, so the merge is a reshape.

:class:`VisualInputs` carries what the decoder takes from outside (``Transformer.trunk(visual=...)``):
the merged image embeddings replace the placeholder tokens' embeddings, and DeepStack feature ``i``
is added to the hidden states at the visual positions after decoder block ``i``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.config.base import Config, require, require_positive
from lockstep.models.common.mrope import MRopeConfig
from lockstep.models.common.rope import rotate_half
from lockstep.ops.attention import AttentionLayer


@dataclasses.dataclass(kw_only=True)
class VisionConfig(Config):
    """Sizes of the Qwen3-VL vision tower (transformers' ``Qwen3VLVisionConfig``)."""

    #: number of ViT blocks
    depth: int = 27
    #: ViT width
    dim: int = 1152
    #: ViT MLP hidden size
    ffn_dim: int = 4304
    #: attention heads
    n_heads: int = 16
    #: input channels
    in_channels: int = 3
    #: patch side in pixels
    patch_size: int = 16
    #: frames per patch (images are repeated to fill it)
    temporal_patch_size: int = 2
    #: side of the square of patches merged into one decoder token
    spatial_merge_size: int = 2
    #: learned position embeddings (a square grid)
    num_position_embeddings: int = 2304
    #: blocks whose output feeds a DeepStack merger (feature i goes to decoder block i)
    deepstack_layers: list[int] = dataclasses.field(default_factory=lambda: [8, 16, 24])
    #: base of the 2-D rotary frequencies
    rope_theta: float = 10000.0
    #: epsilon of every LayerNorm
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def validate(self, path: str = "") -> None:
        for name in ("depth", "dim", "ffn_dim", "n_heads", "in_channels", "patch_size", "temporal_patch_size",
                     "spatial_merge_size", "num_position_embeddings"):
            require_positive(getattr(self, name), f"{path}.{name}")
        require(self.dim % self.n_heads == 0 and self.head_dim % 4 == 0, f"{path}.n_heads",
                f"dim / n_heads must be a multiple of 4 (2-D RoPE), got dim={self.dim}, n_heads={self.n_heads}")
        side = round(self.num_position_embeddings ** 0.5)
        require(side * side == self.num_position_embeddings, f"{path}.num_position_embeddings",
                f"must be a square number, got {self.num_position_embeddings}")
        bad = [i for i in self.deepstack_layers if not 0 <= i < self.depth]
        require(not bad, f"{path}.deepstack_layers", f"indices {bad} are outside [0, depth={self.depth})")
        super().validate(path)

    def build(self, *, out_dim: int) -> "VisionTower":
        return VisionTower(self, out_dim)


@dataclasses.dataclass
class VisionFeatures:
    """The tower's output: merged embeddings ``[M, out_dim]`` (M = patches / merge**2, image after
    image) and one ``[M, out_dim]`` DeepStack feature per DeepStack layer."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


class VisionAttention(AttentionLayer):
    """Bidirectional multi-head attention within each frame, with 2-D RoPE (HF names: qkv, proj)."""

    def __init__(self, dim: int, n_heads: int, backend: str = "sdpa") -> None:
        super().__init__(backend)
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    @property
    def active_backend(self) -> str:
        """The configured kernel, also in batch-invariant mode (whose kernel is causal-only): every frame
        attends alone, in its own call with its own shapes, so its result cannot depend on the batch."""
        return self.backend_name

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, self.head_dim).unbind(1)
        cos, sin = (t.unsqueeze(1) for t in rope)  # rotated in fp32, as transformers does
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        outs = [self.full_attention(*(t.transpose(0, 1)[None] for t in qkv), causal=False)[0].transpose(0, 1)
                for qkv in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return self.proj(torch.cat(outs).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.norm2 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.attn = VisionAttention(config.dim, config.n_heads)
        self.mlp = VisionMLP(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, 2x2 concatenation, MLP; ``norm_after_merge``: the norm sees the concatenation (DeepStack)."""

    def __init__(self, dim: int, merge: int, out_dim: int, eps: float, norm_after_merge: bool) -> None:
        super().__init__()
        self.merged_dim = dim * merge * merge
        self.norm_after_merge = norm_after_merge
        self.norm = nn.LayerNorm(self.merged_dim if norm_after_merge else dim, eps=eps)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged_dim)) if self.norm_after_merge else self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, patch_dim: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(patch_dim, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.to(self.proj.weight.dtype))


def patch_coordinates(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """``[P, 2]`` (row, column) of every patch, frames in order, each frame in merge-block order."""
    rows = []
    for t, h, w in grid_thw.tolist():
        r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        block = [a.reshape(shape).transpose(1, 2).flatten() for a in (r, c)]
        rows.append(torch.stack(block, -1).repeat(t, 1))
    return torch.cat(rows)


def bilinear_taps(coords: torch.Tensor, sizes: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``[P, 4]`` into a flattened ``side x side`` table and their weights: bilinear
    interpolation with aligned corners from the table to each patch's ``(h, w)`` grid."""
    src = coords.float() * (side - 1) / (sizes - 1).clamp(min=1).float()  # [P, 2]
    floor = src.floor()
    frac = src - floor
    lo = floor.long().clamp(0, side - 1)
    hi = (floor.long() + 1).clamp(0, side - 1)
    (r0, c0), (r1, c1) = lo.unbind(-1), hi.unbind(-1)
    low_w = 1 - frac
    high_w = 1 - low_w  # transformers' 1 - |src - (floor + 1)|: the same rounding
    (lr, lc), (hr, hc) = low_w.unbind(-1), high_w.unbind(-1)
    index = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], -1)
    weight = torch.stack([lr * lc, lr * hc, hr * lc, hr * hc], -1)
    return index, weight


class VisionTower(nn.Module):
    """Pixels of one or more images -> merged embeddings and DeepStack features (module docstring)."""

    def __init__(self, config: VisionConfig, out_dim: int) -> None:
        super().__init__()
        config.validate("model.vision")
        self.config = config
        self.side = round(config.num_position_embeddings ** 0.5)
        merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config.patch_dim, config.dim)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.dim)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config.dim, merge, out_dim, config.norm_eps, norm_after_merge=False)
        self.deepstack_merger_list = nn.ModuleList([
            PatchMerger(config.dim, merge, out_dim, config.norm_eps, norm_after_merge=True)
            for _ in config.deepstack_layers])

    def rope(self, coords: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        spatial = self.config.head_dim // 2  # head_dim / 4 frequencies per axis
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        angles = (coords.to(device)[..., None].float() * inv_freq.to(device)).flatten(1)  # [P, rows | cols]
        angles = torch.cat([angles, angles], -1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionFeatures:
        cfg = self.config
        grid_thw = grid_thw.cpu()
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise ValueError(f"pixel_values must be [patches, {cfg.patch_dim}], got {list(pixel_values.shape)}")
        if int(grid_thw.prod(-1).sum()) != pixel_values.shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw {grid_thw.tolist()} "
                             f"describes {int(grid_thw.prod(-1).sum())}")
        device = pixel_values.device
        coords = patch_coordinates(grid_thw, cfg.spatial_merge_size)
        sizes = torch.repeat_interleave(grid_thw[:, 1:], grid_thw.prod(-1), dim=0)
        index, weight = bilinear_taps(coords, sizes, self.side)
        x = self.patch_embed(pixel_values)
        pos = (self.pos_embed(index.to(device)) * weight.to(device)[..., None]).sum(1)
        x = x + pos.to(x.dtype)
        rope = self.rope(coords, device)
        lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).tolist()
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, lengths)
            if i in cfg.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[cfg.deepstack_layers.index(i)](x))
        return VisionFeatures(self.merger(x), deepstack)


def check_vision_language(config: Any, path: str = "model") -> None:
    """What every vision-language decoder config needs (ConfigError naming the field): an mRoPE
    ``rope``, no more DeepStack features than decoder blocks, special tokens inside the vocabulary."""
    require(isinstance(config.rope, MRopeConfig), f"{path}.rope",
            f"{config.family} needs an MRopeConfig (mRoPE sections), got {type(config.rope).__name__}")
    require(len(config.vision.deepstack_layers) <= config.n_layers, f"{path}.vision.deepstack_layers",
            f"{len(config.vision.deepstack_layers)} DeepStack features but only {config.n_layers} decoder blocks")
    for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        value = getattr(config, name)
        require(0 <= value < config.vocab_size, f"{path}.{name}", f"{value} is outside the vocabulary "
                f"[0, {config.vocab_size})")


class VisualInputs:
    """What a decoder takes from the vision tower for one forward (``Transformer.trunk(visual=...)``).

    ``mask [B, T]`` marks the placeholder tokens; ``features`` holds one row per marked position, in
    row-major order over ``[B, T]``."""

    def __init__(self, mask: torch.Tensor, features: VisionFeatures) -> None:
        if int(mask.sum()) != features.embeds.shape[0]:
            raise ValueError(f"tokens hold {int(mask.sum())} image placeholders, the images give "
                             f"{features.embeds.shape[0]} embeddings")
        self.mask, self.features = mask, features

    def merge(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Token embeddings with the image embeddings at the placeholder positions."""
        embeds = self.features.embeds.to(embeddings.dtype)
        return embeddings.masked_scatter(self.mask[..., None], embeds)

    def after_block(self, index: int, h: torch.Tensor) -> torch.Tensor:
        """DeepStack: ``h`` plus feature ``index`` at the visual positions (unchanged past the last)."""
        if index >= len(self.features.deepstack):
            return h
        added = h[self.mask] + self.features.deepstack[index].to(h.dtype)
        return h.index_put((self.mask,), added)
