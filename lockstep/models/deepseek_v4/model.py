"""DeepSeek-V4 (``deepseek_v4``): hyper-connected blocks of compressed attention and V4-routed MoE.

The pieces are shared components: :mod:`lockstep.models.common.hyper_connections` (mHC residual
streams), :mod:`lockstep.models.common.compressed_attention` (sliding-window shared-KV MQA with
sinks, grouped output, plus CSA/HCA compressed entries from :mod:`lockstep.models.common.kv_compressor`)
and :mod:`lockstep.models.common.hash_moe` (sqrt-softplus / hash routing, clamped SwiGLU). This file
only wires them: embeddings are copied onto ``hc_mult`` streams, each block is
``streams = hc_residual(attn(norm(collapse(streams))))`` then the same with the MoE, and a
:class:`~lockstep.models.common.hyper_connections.HyperHead` collapses the streams before the final norm.

Scope: whole-sequence forwards (training, scoring) from position 0, and generation through the
engine's cache (``trunk(cache=...)``: each block's attention gets ``cache.layer(name)``,
:mod:`lockstep.generate.compressed_cache`; hash routing reads the step's token ids); no MTP, no
tensor parallelism, and batch-invariant mode is refused (:meth:`DeepSeekV4.trunk`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from lockstep import numerics
from lockstep.config.base import ConfigError, require, require_choice, require_positive
from lockstep.models.common.compressed_attention import LAYER_TYPES, CompressedAttention
from lockstep.models.common.hash_moe import RoutedMoE
from lockstep.models.common.hyper_connections import HyperConnection, HyperHead, hyper_residual
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.norm import RMSNorm
from lockstep.models.common.rope_yarn import YarnRopeConfig
from lockstep.models.common.transformer import Transformer, TransformerConfig

FAMILY = "deepseek_v4"
MLP_LAYER_TYPES = ("hash_moe", "moe")


def _default_moe() -> MoEConfig:
    return MoEConfig(n_routed_experts=8, n_activated=2, moe_ffn_dim=32, n_shared_experts=1,
                     score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=1.5)


@dataclasses.dataclass(kw_only=True)
class DeepSeekV4Config(TransformerConfig):
    """DeepSeek-V4 sizes. ``head_dim`` is the (shared) query/key/value head size, ``rope_dim`` its
    rotated tail; ``feed_forward`` is the routed MoE (its ``score_func`` is unused: V4 scores with
    sqrt(softplus)); ``layer_types`` / ``mlp_layer_types`` have one entry per layer."""

    family: str = FAMILY
    n_kv_heads: int = 1
    head_dim: int = 64
    rope_dim: int = 16
    #: RoPE of the pure sliding-window blocks (plain: its scaling must be "none")
    main_rope: YarnRopeConfig = dataclasses.field(default_factory=lambda: YarnRopeConfig(theta=10000.0,
                                                                                          scaling="none"))
    #: RoPE of the CSA/HCA blocks, their compressors and indexers (YaRN in the released models)
    compress_rope: YarnRopeConfig = dataclasses.field(default_factory=lambda: YarnRopeConfig(theta=160000.0,
                                                                                              scaling="none"))
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 32
    sliding_window: int = 8
    layer_types: list[str] = dataclasses.field(default_factory=list)
    csa_rate: int = 4
    hca_rate: int = 8
    index_n_heads: int = 4
    index_head_dim: int = 16
    index_topk: int = 4
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    mlp_layer_types: list[str] = dataclasses.field(default_factory=list)
    swiglu_limit: float = 10.0
    feed_forward: MoEConfig = dataclasses.field(default_factory=_default_moe)

    def validate(self, path: str = "model") -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups",
                     "o_lora_rank", "sliding_window", "csa_rate", "hca_rate", "hc_mult", "hc_sinkhorn_iters"):
            require_positive(getattr(self, name), f"{path}.{name}")
        require(self.n_kv_heads == 1, f"{path}.n_kv_heads", "DeepSeek-V4 has one shared key=value head")
        require(self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0, f"{path}.rope_dim",
                f"must be even and <= head_dim={self.head_dim}, got {self.rope_dim}")
        require(self.n_heads % self.o_groups == 0, f"{path}.o_groups", f"must divide n_heads={self.n_heads}")
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)):
            require(len(types) == self.n_layers, f"{path}.{name}",
                    f"needs one entry per layer ({self.n_layers}), got {len(types)}")
            for i, t in enumerate(types):
                require_choice(t, allowed, f"{path}.{name}[{i}]")
        if "compressed_sparse_attention" in self.layer_types:
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                require_positive(getattr(self, name), f"{path}.{name}")
        require(not self.tie_embeddings, f"{path}.tie_embeddings", "DeepSeek-V4 has a separate output head")
        self.feed_forward.validate(f"{path}.feed_forward")
        self.main_rope.validate(f"{path}.main_rope")
        self.compress_rope.validate(f"{path}.compress_rope")
        require(self.compress_rope.scaling in ("none", "yarn"), f"{path}.compress_rope.scaling",
                f"must be 'none' or 'yarn', got {self.compress_rope.scaling!r}")
        require(self.main_rope.scaling == "none", f"{path}.main_rope.scaling",
                f"DeepSeek-V4's sliding-window blocks use plain RoPE, got {self.main_rope.scaling!r}")

    def batch_invariant_refusal(self) -> str:
        """Why batch-invariant mode is refused (read by the trainer's and RL's config validation via
        :func:`lockstep.models.common.sparse_indexer.refuse_batch_invariant`, and by the forward)."""
        return ("not supported by deepseek_v4 (ops 'compressed_attention.eager' (sliding-window + compressed keys "
                "with sinks), 'kv_compressor.indexer_topk', 'hyper_connections.sinkhorn' have no batch-invariant "
                "kernels, docs/numerics.md); set numerics.batch_invariant=false")

    def rate(self, layer_type: str) -> int:
        return {"compressed_sparse_attention": self.csa_rate, "heavily_compressed_attention": self.hca_rate}.get(
            layer_type, 0)

    def build(self) -> "DeepSeekV4":
        return DeepSeekV4(self)


class DeepSeekV4Block(nn.Module):
    """Attention then MoE, each between a hyper-connection and its residual merge."""

    def __init__(self, config: DeepSeekV4Config, i: int) -> None:
        super().__init__()
        c = config
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = CompressedAttention(
            dim=c.dim, n_heads=c.n_heads, head_dim=c.head_dim, rope_dim=c.rope_dim, q_lora_rank=c.q_lora_rank,
            o_groups=c.o_groups, o_lora_rank=c.o_lora_rank, sliding_window=c.sliding_window,
            layer_type=c.layer_types[i], rate=c.rate(c.layer_types[i]), main_rope=c.main_rope,
            compress_rope=c.compress_rope, norm_eps=c.norm_eps, index_n_heads=c.index_n_heads,
            index_head_dim=c.index_head_dim, index_topk=c.index_topk)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.feed_forward = RoutedMoE(c.feed_forward, c.dim, c.feed_forward.moe_ffn_dim, c.vocab_size,
                                      c.mlp_layer_types[i] == "hash_moe", c.swiglu_limit)
        self.attn_hc = HyperConnection(c.dim, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)
        self.ffn_hc = HyperConnection(c.dim, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                cache: Any = None) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = hyper_residual(post, comb, self.attention(self.attention_norm(x), positions, cache), streams)
        post, comb, x = self.ffn_hc(streams)
        return hyper_residual(post, comb, self.feed_forward(self.ffn_norm(x), tokens), streams)


class DeepSeekV4(Transformer):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab]`` (the :class:`Transformer` interface)."""

    def __init__(self, config: DeepSeekV4Config) -> None:
        nn.Module.__init__(self)
        config.validate()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): DeepSeekV4Block(config, i) for i in range(config.n_layers)})
        self.hc_head = HyperHead(config.dim, config.hc_mult, config.hc_eps, config.norm_eps)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def trunk(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: Any = None,
              visual: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, embeddings, final-normed hidden states) of whole sequences from position 0, or
        (``cache``, generation) of each sequence's new ``tokens [B, T]`` at ``positions [B, T]``."""
        if numerics.is_batch_invariant():
            raise ConfigError(f"numerics.batch_invariant: {self.config.batch_invariant_refusal()}")
        if visual is not None:
            raise ConfigError("model.family: deepseek_v4 takes no vision input")
        if cache is None:
            arange = torch.arange(tokens.shape[1], device=tokens.device)[None]
            if positions is not None and not torch.equal(positions, arange.expand_as(positions)):
                raise ConfigError("positions: deepseek_v4 runs whole sequences from position 0 (no packing offsets)")
            positions = arange
        elif positions is None:
            raise ConfigError("positions: a cached deepseek_v4 forward needs each new token's position")
        embeddings = self.tok_embeddings(tokens)
        streams = embeddings.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for name, layer in self.layers.items():
            streams = layer(streams, positions, tokens, None if cache is None else cache.layer(name))
        return positions, embeddings, self.norm(self.hc_head(streams))

    def flops_per_token(self, seq_len: int) -> float:
        """6 x active matmul params plus attention over at most ``sliding_window`` + compressed keys."""
        c = self.config
        matmul = self.num_params(exclude_embedding=True)
        for module in self.modules():
            if hasattr(module, "active_matmul_params"):
                matmul += module.active_matmul_params() - sum(p.numel() for p in module.parameters())
        keys = min(seq_len, c.sliding_window) + seq_len // max(c.csa_rate, 1)
        return 6 * matmul + 12 * c.n_layers * c.n_heads * c.head_dim * keys


__all__ = ["FAMILY", "DeepSeekV4", "DeepSeekV4Block", "DeepSeekV4Config", "MLP_LAYER_TYPES"]
