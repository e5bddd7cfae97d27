"""MoonViT, the Kimi K2.5 vision tower, and its projector into the decoder (transformers' ``Kimi_K25VisionModel``
and ``Kimi_K25MultimodalProjection``).

``MoonViT(pixel_values [P, C*p*p], grid_thw [N, 3]) -> VisionFeatures`` (no DeepStack features):

1. patch embedding: a linear map of each flattened ``(C, p, p)`` patch (transformers' Conv2d with kernel =
   stride; :class:`~lockstep.models.common.vision.PatchEmbed`);
2. a learned ``side x side`` position table, resampled to each image's ``h x w`` patch grid by bicubic
   interpolation (half-pixel centres, ``F.interpolate(mode="bicubic", align_corners=False)``, Keys kernel
   ``a = -0.75``, border clamping) as 16 weighted taps per patch;
3. ``depth`` pre-norm ViT blocks, the Qwen3-VL blocks of :mod:`lockstep.models.common.vision` (bidirectional
   attention within each image, GELU-tanh MLP); only the 2-D RoPE layout differs: the column and row
   frequencies interleave (``[c f0, r f0, c f1, r f1, ...]``) instead of filling a half each;
4. a final LayerNorm, then each 2x2 block of patches (patches arrive in raster order, as the processor writes
   them) is LayerNormed per patch, concatenated and mapped by an MLP (exact GELU) to the decoder width.

Images only: a clip with ``t > 1`` frames (video, with its temporal sinusoid and pooling) is refused.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.config.base import Config, require, require_positive
from lockstep.models.common.vision import PatchEmbed, VisionBlock, VisionFeatures, patch_coordinates


@dataclasses.dataclass(kw_only=True)
class MoonViTConfig(Config):
    """Sizes of MoonViT (transformers' ``Kimi_K25VisionConfig``) and of the projector after it."""

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
    patch_size: int = 14
    #: side of the square learned position table (pos_emb_height = pos_emb_width)
    pos_emb_side: int = 64
    #: side of the square of patches merged into one decoder token
    merge_size: int = 2
    #: base of the 2-D rotary frequencies
    rope_theta: float = 10000.0
    #: epsilon of the ViT LayerNorms (fixed at 1e-5 in transformers)
    norm_eps: float = 1e-5
    #: epsilon of the projector's LayerNorm
    projection_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size ** 2

    def validate(self, path: str = "") -> None:
        for name in ("depth", "dim", "ffn_dim", "n_heads", "in_channels", "patch_size", "pos_emb_side", "merge_size"):
            require_positive(getattr(self, name), f"{path}.{name}")
        require(self.dim % self.n_heads == 0 and self.head_dim % 4 == 0, f"{path}.n_heads",
                f"dim / n_heads must be a multiple of 4 (2-D RoPE), got dim={self.dim}, n_heads={self.n_heads}")
        super().validate(path)

    def build(self, *, out_dim: int) -> "MoonViT":
        return MoonViT(self, out_dim)


def bicubic_taps(coords: torch.Tensor, sizes: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``[P, 16]`` into a flattened ``side x side`` table and their weights: bicubic resampling
    (half-pixel centres, Keys ``a = -0.75``, border clamp) from the table to each patch's ``(h, w)`` grid."""
    src = (coords.float() + 0.5) * side / sizes.float() - 0.5  # [P, 2]
    floor = src.floor()
    offsets = torch.arange(-1, 3)
    taps = (floor.long()[..., None] + offsets).clamp(0, side - 1)  # [P, 2, 4]
    d = (src[..., None] - floor[..., None] - offsets).abs()
    a = -0.75
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    weight = torch.where(d <= 1, near, far)
    index = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).flatten(1)
    return index, (weight[:, 0, :, None] * weight[:, 1, None, :]).flatten(1)


def merge_index(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """``[M, merge*merge]``: the raster-order patch indices of each merged token, image after image."""
    rows, start = [], 0
    for _, h, w in grid_thw.tolist():
        base = torch.arange(start, start + h * w).view(h // merge, merge, w // merge, merge)
        rows.append(base.permute(0, 2, 1, 3).reshape(-1, merge * merge))
        start += h * w
    return torch.cat(rows)


class MoonViTProjector(nn.Module):
    """Per-patch LayerNorm, ``merge*merge`` patches concatenated, Linear-GELU-Linear (HF ``mm_projector``)."""

    def __init__(self, dim: int, merge: int, out_dim: int, eps: float) -> None:
        super().__init__()
        self.merged_dim = dim * merge * merge
        self.pre_norm = nn.LayerNorm(dim, eps=eps)
        self.in_proj = nn.Linear(self.merged_dim, self.merged_dim)
        self.out_proj = nn.Linear(self.merged_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, merge*merge, dim]`` -> ``[M, out_dim]``."""
        return self.out_proj(F.gelu(self.in_proj(self.pre_norm(x).reshape(-1, self.merged_dim))))


class MoonViT(nn.Module):
    """Pixels of one or more images -> merged embeddings in the decoder width (module docstring)."""

    def __init__(self, config: MoonViTConfig, out_dim: int) -> None:
        super().__init__()
        config.validate("model.vision")
        self.config = config
        side = config.pos_emb_side
        self.patch_embed = PatchEmbed(config.patch_dim, config.dim)
        self.pos_embed = nn.Parameter(torch.zeros(side, side, config.dim))  # HF [height, width, dim]
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.final_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.projector = MoonViTProjector(config.dim, config.merge_size, out_dim, config.projection_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pos_embed)  # as transformers: std 1, cut at +-2

    def rope(self, coords: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        spatial = self.config.head_dim // 2  # head_dim / 4 frequencies per axis
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        angles = coords.to(device)[..., None].float() * inv_freq.to(device)  # [P, (row, col), F]
        angles = angles.transpose(1, 2).flip(-1).flatten(1)  # [P, F * (col, row)]
        angles = torch.cat([angles, angles], -1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionFeatures:
        cfg = self.config
        grid_thw = grid_thw.cpu()
        if pixel_values.dim() == 4:  # the processor's [P, C, p, p]
            pixel_values = pixel_values.flatten(1)
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise ValueError(f"pixel_values must be [patches, {cfg.patch_dim}], got {list(pixel_values.shape)}")
        if grid_thw.numel() and int(grid_thw[:, 0].max()) != 1:
            raise ValueError(f"grid_thw {grid_thw.tolist()}: MoonViT here takes images (t = 1); videos are not "
                             "implemented")
        if int(grid_thw.prod(-1).sum()) != pixel_values.shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw {grid_thw.tolist()} "
                             f"describes {int(grid_thw.prod(-1).sum())}")
        bad = [g for g in grid_thw.tolist() if g[1] % cfg.merge_size or g[2] % cfg.merge_size]
        if bad:
            raise ValueError(f"grid_thw {bad}: h and w must be multiples of merge_size={cfg.merge_size}")
        device = pixel_values.device
        coords = patch_coordinates(grid_thw, 1)  # raster order
        sizes = torch.repeat_interleave(grid_thw[:, 1:], grid_thw.prod(-1), dim=0)
        index, weight = bicubic_taps(coords, sizes, cfg.pos_emb_side)
        x = self.patch_embed(pixel_values)
        table = self.pos_embed.flatten(0, 1)
        pos = F.embedding_bag(index.to(device), table, per_sample_weights=weight.to(device, table.dtype),
                              mode="sum") if index.numel() else table[:0]
        x = x + pos.to(x.dtype)
        rope = self.rope(coords, device)
        lengths = (grid_thw[:, 1] * grid_thw[:, 2]).tolist()
        for block in self.blocks:
            x = block(x, rope, lengths)
        x = self.final_norm(x)
        return VisionFeatures(self.projector(x[merge_index(grid_thw, cfg.merge_size).to(device)]), [])
