"""Rotary position embeddings (half-rotation layout, as in Hugging Face checkpoints).

Supports plain RoPE and Llama-3 frequency scaling. The cos/sin tables are non-persistent buffers
recomputed by ``reset_parameters`` so a model built on the meta device materialises correctly.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from lockstep.compile.local import local_compile
from lockstep.config.base import Config, require, require_choice, require_positive
from lockstep.graph.state import is_capturing


@dataclasses.dataclass(kw_only=True)
class RopeConfig(Config):
    """Rotary embedding frequencies."""

    #: base of the rotary frequencies
    theta: float = 10000.0
    #: frequency scaling: "none" or "llama3"
    scaling: str = "none"
    #: llama3 scaling: factor by which the context was extended
    factor: float = 8.0
    #: llama3 scaling: wavelengths longer than original/low_freq_factor are divided by factor
    low_freq_factor: float = 1.0
    #: llama3 scaling: wavelengths shorter than original/high_freq_factor are kept
    high_freq_factor: float = 4.0
    #: llama3 scaling: the pre-extension context length
    original_max_position_embeddings: int = 8192

    def validate(self, path: str = "") -> None:
        require_positive(self.theta, f"{path}.theta")
        require_choice(self.scaling, ["none", "llama3"], f"{path}.scaling")
        if self.scaling == "llama3":
            require_positive(self.factor, f"{path}.factor")
            require(
                self.high_freq_factor > self.low_freq_factor,
                f"{path}.high_freq_factor",
                "must exceed low_freq_factor",
            )

    def inverse_frequencies(self, head_dim: int) -> torch.Tensor:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.scaling == "llama3":
            inv_freq = llama3_scale(inv_freq, self)
        return inv_freq

    def build(self, *, head_dim: int, max_seq_len: int) -> "RotaryEmbedding":
        return RotaryEmbedding(self, head_dim, max_seq_len)


def llama3_scale(inv_freq: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    """``inv_freq`` with Llama 3.1's wavelength-dependent scaling (long wavelengths slowed by ``factor``,
    short ones kept, a smooth blend between)."""
    low_wavelen = cfg.original_max_position_embeddings / cfg.low_freq_factor
    high_wavelen = cfg.original_max_position_embeddings / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (cfg.original_max_position_embeddings / wavelen - cfg.low_freq_factor) / (
        cfg.high_freq_factor - cfg.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables for positions [0, max_seq_len) and looks them up by position."""

    def __init__(self, config: RopeConfig, head_dim: int, max_seq_len: int) -> None:
        super().__init__()
        self.config, self.head_dim, self.max_seq_len = config, head_dim, max_seq_len
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        if not self.cos.is_meta:  # tables are not in state dicts: a plain build() must fill them
            self.reset_parameters()

    def reset_parameters(self) -> None:
        inv_freq = self.config.inverse_frequencies(self.head_dim).to(self.cos.device)
        positions = torch.arange(self.max_seq_len, device=self.cos.device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [..., T, head_dim] for integer positions [..., T].

        The bound check reads a tensor value, so it is skipped while torch.compile or a graph capture traces
        (it would break the graph, or bake one batch's value into it); a compiled caller checks positions
        itself (the generation engine caps every sequence at max_seq_len before it runs).
        """
        if positions.numel() and not is_capturing() and int(positions.max()) >= self.max_seq_len:
            raise ValueError(
                f"position {int(positions.max())} is beyond max_seq_len={self.max_seq_len}"
            )
        return self.cos[positions], self.sin[positions]

    def prefix(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[1, length, head_dim]`` of positions ``0..length-1`` -- ``forward(arange(length)[None])``
        -- as views of the tables; the bound check reads an int, not a tensor, so a training
        forward does not wait for the device here."""
        if length > self.max_seq_len:
            raise ValueError(f"position {length - 1} is beyond max_seq_len={self.max_seq_len}")
        return self.cos[None, :length], self.sin[None, :length]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@local_compile("rope", batch_invariant=True)
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [B or 1, T, D] (broadcast over heads)."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin
