"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4 section 2.2; Xie et al., 2026).

The residual stream is ``n`` parallel streams ``[B, T, n, D]``. Before a block (attention or MoE) a
:class:`HyperConnection` reads the flattened streams and produces three mixings:

* ``pre [B, T, n]``: collapses the streams into the block's input ``sum_s pre_s * x_s``;
* ``post [B, T, n]``: spreads the block's output back over the streams;
* ``comb [B, T, n, n]``: mixes the streams themselves, projected (Sinkhorn-Knopp) onto
  doubly-stochastic matrices so the residual path stays non-expansive.

``streams' = post * block_out + comb^T @ streams`` (:func:`hyper_residual`). The mixings are computed
in fp32 from an unweighted RMSNorm of the flattened streams. :class:`HyperHead` collapses the streams
once more before the final norm. Parameter names (``fn``, ``base``, ``scale``; ``hc_fn``, ``hc_base``,
``hc_scale``) follow transformers' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim (statistics in fp32, result in ``x``'s dtype), no weight."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax of ``logits [..., n, n]`` then alternating column/row normalisation (``iters``
    column passes in all): an approximately doubly-stochastic matrix, as DeepSeek-V4 computes it."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """The (pre, post, comb) mixings of ``n_streams`` residual streams around one block."""

    def __init__(self, dim: int, n_streams: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.sinkhorn_iters, self.hc_eps, self.norm_eps = n_streams, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + n_streams) * n_streams
        self.fn = nn.Parameter(torch.empty(width, n_streams * dim))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))
        self.init_std = 0.02
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.fn, std=self.init_std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [B, T, n, D]`` -> ``(post [B, T, n], comb [B, T, n, n], collapsed [B, T, D])``."""
        n = self.n
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = sinkhorn(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), self.sinkhorn_iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def hyper_residual(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor,
                   streams: torch.Tensor) -> torch.Tensor:
    """The streams after a block: ``post * block_out + comb^T @ streams`` (``[B, T, n, D]``)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final collapse of the streams ``[B, T, n, D] -> [B, T, D]`` (sigmoid-weighted sum)."""

    def __init__(self, dim: int, n_streams: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n_streams, n_streams * dim))
        self.hc_base = nn.Parameter(torch.empty(n_streams))
        self.hc_scale = nn.Parameter(torch.empty(1))
        self.init_std = 0.02
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.hc_fn, std=self.init_std)
        nn.init.zeros_(self.hc_base)
        nn.init.ones_(self.hc_scale)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


def param_count(dim: int, n_streams: int) -> int:
    """Parameters of one :class:`HyperConnection`."""
    width = (2 + n_streams) * n_streams
    return width * n_streams * dim + width + 3


__all__ = ["HyperConnection", "HyperHead", "hyper_residual", "param_count", "sinkhorn", "unweighted_rms_norm"]
