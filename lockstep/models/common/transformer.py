"""The decoder-only transformer every family wires up: embeddings, blocks, final norm, head.

The config names the architecture's sizes and, per module path, the component config that builds
it (its *slots*). Families choose default slots; users replace them by glob overrides without
touching this file. Build on the meta device, then ``to_empty`` and ``init_weights``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from lockstep.config.base import Config, require, require_positive
from lockstep.config.overrides import ComponentOverride, apply_overrides
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.mlp import FeedForwardConfig, SwiGLUConfig
from lockstep.models.common.moe import apply_routing_updates
from lockstep.models.common.norm import NormConfig, RMSNormConfig
from lockstep.models.common.rope import RopeConfig


@dataclasses.dataclass(kw_only=True)
class TransformerConfig(Config):
    """Sizes and components of a decoder-only transformer."""

    #: model family name in the registry (llama3, qwen3, ...)
    family: str = "llama3"
    #: flavor the sizes came from (informational; the fields below are what is built)
    flavor: str = "custom"
    #: vocabulary size (rows of the embedding and the output head)
    vocab_size: int = 4096
    #: hidden size
    dim: int = 256
    #: number of transformer blocks
    n_layers: int = 4
    #: number of query heads
    n_heads: int = 4
    #: number of key/value heads (grouped-query attention); must divide n_heads
    n_kv_heads: int = 4
    #: size of each head; 0 means dim // n_heads
    head_dim: int = 0
    #: hidden size of the feed-forward layers
    ffn_dim: int = 768
    #: epsilon of every RMSNorm
    norm_eps: float = 1e-5
    #: longest sequence the rotary tables cover
    max_seq_len: int = 2048
    #: share the embedding matrix with the output head
    tie_embeddings: bool = False
    #: std of the normal init of weights (output projections are further scaled by depth)
    init_std: float = 0.02
    #: rotary position embedding settings
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    #: attention config of every block (overridable per layer)
    attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    #: feed-forward config of every block (overridable per layer)
    feed_forward: FeedForwardConfig = dataclasses.field(default_factory=SwiGLUConfig)
    #: norm config of every norm (overridable per module)
    norm: NormConfig = dataclasses.field(default_factory=RMSNormConfig)
    #: component overrides by module-path glob, applied in order
    overrides: list[ComponentOverride] = dataclasses.field(default_factory=list)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def validate(self, path: str = "model") -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            require_positive(getattr(self, name), f"{path}.{name}")
        require_positive(self.norm_eps, f"{path}.norm_eps")
        require(self.head_dim >= 0, f"{path}.head_dim", f"must be >= 0, got {self.head_dim}")
        if not self.head_dim:
            require(
                self.dim % self.n_heads == 0,
                f"{path}.n_heads",
                f"must divide dim={self.dim} (got {self.n_heads}); or set head_dim explicitly",
            )
        require(
            self.n_heads % self.n_kv_heads == 0,
            f"{path}.n_kv_heads",
            f"must divide n_heads={self.n_heads}, got {self.n_kv_heads}",
        )
        super().validate(path)
        self.slots()  # overrides must resolve: conflicts and dead patterns fail here, before any work

    def default_slots(self) -> dict[str, Config]:
        """Module path -> component config, before overrides."""
        slots: dict[str, Config] = {}
        for i in range(self.n_layers):
            slots[f"layers.{i}.attention_norm"] = self.norm
            slots[f"layers.{i}.attention"] = self.attention
            slots[f"layers.{i}.ffn_norm"] = self.norm
            slots[f"layers.{i}.feed_forward"] = self.feed_forward
        slots["norm"] = self.norm
        return slots

    def slots(self) -> dict[str, Config]:
        """Module path -> component config with every override applied."""
        return apply_overrides(self.default_slots(), self.overrides)

    def build(self) -> "Transformer":
        return Transformer(self)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, config: TransformerConfig, slots: dict[str, Config], prefix: str) -> None:
        super().__init__()
        head_dim = config.resolved_head_dim
        self.attention_norm = slots[f"{prefix}.attention_norm"].build(dim=config.dim, eps=config.norm_eps)
        self.attention = slots[f"{prefix}.attention"].build(
            dim=config.dim,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            head_dim=head_dim,
            norm_eps=config.norm_eps,
        )
        self.ffn_norm = slots[f"{prefix}.ffn_norm"].build(dim=config.dim, eps=config.norm_eps)
        self.feed_forward = slots[f"{prefix}.feed_forward"].build(dim=config.dim, hidden_dim=config.ffn_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: Any = None) -> torch.Tensor:
        if cache is None:
            x = x + self.attention(self.attention_norm(x), rope)
        else:  # generation: the attention reads and extends this layer's KV cache
            x = x + self.attention(self.attention_norm(x), rope, cache=cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        slots = config.slots()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.rope = config.rope.build(head_dim=config.resolved_head_dim, max_seq_len=config.max_seq_len)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config, slots, f"layers.{i}") for i in range(config.n_layers)}
        )
        self.norm = slots["norm"].build(dim=config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head; needed again after ``to_empty``."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def trunk(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: Any = None,
              visual: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, token embeddings, final-normed hidden states): everything but the head.

        Families that add heads (DeepSeek-V3's MTP) build on this instead of copying the loop.
        ``cache`` (generation, :mod:`lockstep.generate`): ``tokens [B, T]`` are each sequence's new
        tokens at ``positions [B, T]``, and ``cache.layer(name)`` is handed to block ``name``.
        ``visual`` (vision-language families, :class:`lockstep.models.common.vision.VisualInputs`):
        ``visual.merge`` places image embeddings among the token embeddings and ``visual.after_block(i, h)``
        adds DeepStack features after block ``i``; mRoPE ``positions`` may then be ``[3, B, T]``.
        """
        if positions is None:  # 0..T-1: the tables' first rows (no bound check reading a tensor)
            positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
            rope = self.rope.prefix(tokens.shape[1])
        else:
            rope = self.rope(positions)
        embeddings = self.tok_embeddings(tokens)
        if visual is not None:
            embeddings = visual.merge(embeddings)
        h = embeddings
        for i, (name, layer) in enumerate(self.layers.items()):
            h = layer(h, rope) if cache is None else layer(h, rope, cache=cache.layer(name))
            if visual is not None:
                h = visual.after_block(i, h)
        return positions, embeddings, self.norm(h)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.output(self.trunk(tokens, positions)[2])

    def pop_auxiliary(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | float]]:
        """Auxiliary losses (already weighted, added to the training loss) and metrics that
        submodules recorded during the last forward, e.g. MoE load-balancing terms and expert load.

        Any submodule may define ``pop_auxiliary()`` returning the same pair; names are prefixed
        with the module path so layers stay apart. Calling this clears what was recorded.
        """
        losses: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        if not hasattr(self, "_auxiliary_sources"):  # the module tree is fixed once built
            self._auxiliary_sources = [(n, m) for n, m in self.named_modules()
                                       if m is not self and hasattr(m, "pop_auxiliary")]
        for name, module in self._auxiliary_sources:
            sub_losses, sub_metrics = module.pop_auxiliary()
            losses.update({f"{name}/{k}": v for k, v in sub_losses.items()})
            metrics.update({f"{name}/{k}": v for k, v in sub_metrics.items()})
        return losses, metrics

    def after_optimizer_step(self) -> None:
        """Call once after every optimizer step: applies the step's pending MoE routing-bias updates
        (aux-loss-free balancing, pooled over the step's micro-batches; see ``models.common.moe``).
        A no-op for dense models; a collective for MoE models under data parallelism."""
        apply_routing_updates(self)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter and buffer in place (works after ``to_empty``)."""
        if seed is not None:
            torch.manual_seed(seed)
        std = self.config.init_std
        depth_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                # projections back into the residual stream (attention out, any MLP's down proj)
                is_residual_out = name.endswith((".wo", ".w2"))
                nn.init.normal_(module.weight, mean=0.0, std=depth_std if is_residual_out else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif hasattr(module, "reset_parameters") and not isinstance(module, (Transformer,)):
                if hasattr(module, "out_init_std"):  # stacked experts: same scheme as Linear layers
                    module.init_std, module.out_init_std = std, depth_std
                module.reset_parameters()

    def num_params(self, exclude_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            total -= self.tok_embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul params + causal attention scores and values.

        Attention: per layer and token, q.k and p.v each cost 2 * head_dim * n_heads * (seq/2)
        multiply-adds on average under a causal mask, forward; backward doubles that again.
        """
        matmul_params = self.num_params(exclude_embedding=True)
        if self.config.tie_embeddings:
            matmul_params += self.output.weight.numel()
        for module in self.modules():  # sparse layers (MoE) count only what one token uses
            if hasattr(module, "active_matmul_params"):
                matmul_params += module.active_matmul_params() - sum(p.numel() for p in module.parameters())
        norm_params = sum(p.numel() for n, p in self.named_parameters() if "norm" in n)
        attn = 6 * self.config.n_layers * self.config.n_heads * self.config.resolved_head_dim * seq_len
        return 6 * (matmul_params - norm_params) + attn


def build_meta_model(config: TransformerConfig) -> Transformer:
    """The model of ``config`` on the meta device (no storage is allocated)."""
    with torch.device("meta"):
        return config.build()


def build_model(config: TransformerConfig, device: str | torch.device = "cpu", seed: int | None = 0) -> Transformer:
    """Build on the meta device, materialise on ``device`` and initialise deterministically."""
    model = build_meta_model(config)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model
