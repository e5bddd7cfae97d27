"""DeepSeek-V3 / Kimi-K2: MLA attention everywhere, dense first layers, then MoE, plus optional MTP.

``DeepSeekV3Config`` is a :class:`TransformerConfig` whose

* ``attention`` is an :class:`MLAConfig` and whose rope tables are built for ``qk_rope_head_dim``
  (``resolved_head_dim`` reports it, exactly as HF sets ``head_dim = qk_rope_head_dim``);
  MLA's softmax scale picks up YaRN's ``mscale_all_dim`` correction from ``rope`` when its
  ``softmax_mscale`` is left at 0;
* ``feed_forward`` is the MoE of layers ``>= first_k_dense_replace`` and ``dense_feed_forward`` the
  SwiGLU (of ``ffn_dim``) of the first ``first_k_dense_replace`` layers (the Qwen3-MoE family's naming);
* ``n_mtp`` multi-token-prediction modules (DeepSeek-V3 section 2.2) train extra heads.

MTP. Module ``k`` (1-based depth) at position ``i`` combines the previous depth's representation
``h^{k-1}_i`` (depth 0: the main model's final-normed hidden state) with the embedding of input
token ``t_{i+k}``: ``h'_i = proj([enorm(emb(t_{i+k})); hnorm(h^{k-1}_i)])``, runs one transformer
block (MLA + MoE, causal over the depth's positions), then its own final norm, and predicts
``t_{i+k+1}`` with the *shared* output head (and shared embedding). Targets are taken from the
inputs alone, so depth ``k`` scores the ``T - k - 1`` positions whose target lies inside the input
sequence. The MTP loss is ``mtp_loss_weight * mean_k CE_k`` (DeepSeek-V3's lambda / D * sum_k),
recorded in training mode only and returned by ``pop_auxiliary()`` as ``mtp/loss`` (with
unweighted per-depth metrics ``mtp/loss_{k}``); the trainer adds it to the LM loss. MTP never
changes the main logits. Rotary positions of depth ``k`` are those of the embedded tokens (``i+k``),
as transformers' ``MtpModel`` feeds them; RoPE is relative, so this equals using ``i``.

The per-module final norm is the checkpoint's ``shared_head.norm`` (DeepSeek's released MTP layer has
one per module); the head itself is shared. The order of the concatenation (embedding first) and the
post-norm input follow the DeepSeek checkpoint as transformers' ``MtpLayer`` and vLLM read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.config.base import Config, require
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.mla import MLAConfig
from lockstep.models.common.mlp import FeedForwardConfig, SwiGLUConfig
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.rope import RopeConfig
from lockstep.models.common.rope_yarn import YarnRopeConfig, softmax_mscale_of
from lockstep.models.common.transformer import Transformer, TransformerBlock, TransformerConfig


def _default_moe() -> MoEConfig:
    return MoEConfig(n_routed_experts=8, n_activated=2, moe_ffn_dim=64, n_shared_experts=1,
                     score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5)


@dataclasses.dataclass(kw_only=True)
class DeepSeekV3Config(TransformerConfig):
    """DeepSeek-V3 architecture: MLA, dense-then-MoE feed-forwards, optional multi-token prediction.

    ``head_dim`` is the width of the rope tables and must be 0 or ``attention.qk_rope_head_dim``;
    MLA's own head sizes live in ``attention``. ``n_kv_heads`` must equal ``n_heads``.
    """

    family: str = "deepseek_v3"
    #: rotary settings (YaRN in the released models); tables cover qk_rope_head_dim dims
    rope: RopeConfig = dataclasses.field(default_factory=lambda: YarnRopeConfig(scaling="none"))
    #: attention of every block and MTP block: multi-head latent attention
    attention: AttentionConfig = dataclasses.field(default_factory=MLAConfig)
    #: feed-forward of layers >= first_k_dense_replace and of every MTP block (the MoE)
    feed_forward: FeedForwardConfig = dataclasses.field(default_factory=_default_moe)
    #: feed-forward of the first first_k_dense_replace layers (a SwiGLU of ffn_dim)
    dense_feed_forward: FeedForwardConfig = dataclasses.field(default_factory=SwiGLUConfig)
    #: layers [0, first_k_dense_replace) are dense; n_layers makes every main layer dense
    first_k_dense_replace: int = 1
    #: multi-token-prediction depth (DeepSeek-V3 trains 1); 0 disables MTP
    n_mtp: int = 0
    #: weight of the MTP loss (mean over depths) added to the training loss; 0 skips computing it
    mtp_loss_weight: float = 0.3

    @property
    def resolved_head_dim(self) -> int:
        """The rope table width: MLA's qk_rope_head_dim (HF's head_dim for this model)."""
        if isinstance(self.attention, MLAConfig):
            return self.attention.qk_rope_head_dim
        return super().resolved_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def validate(self, path: str = "model") -> None:
        require(self.first_k_dense_replace >= 0, f"{path}.first_k_dense_replace",
                f"must be >= 0, got {self.first_k_dense_replace}")
        require(self.n_mtp >= 0, f"{path}.n_mtp", f"must be >= 0 (0 disables MTP), got {self.n_mtp}")
        require(self.mtp_loss_weight >= 0, f"{path}.mtp_loss_weight", f"must be >= 0, got {self.mtp_loss_weight}")
        require(self.n_kv_heads == self.n_heads, f"{path}.n_kv_heads",
                f"MLA has one key/value head per query head: must equal n_heads={self.n_heads}, got {self.n_kv_heads}")
        if isinstance(self.attention, MLAConfig):
            require(self.head_dim in (0, self.attention.qk_rope_head_dim), f"{path}.head_dim",
                    f"is the rope width and must be 0 or attention.qk_rope_head_dim="
                    f"{self.attention.qk_rope_head_dim}, got {self.head_dim}")
        super().validate(path)
        rope_dim = self.resolved_head_dim
        for slot, cfg in self.slots().items():
            if isinstance(cfg, MLAConfig):
                require(cfg.qk_rope_head_dim == rope_dim, f"{path}.overrides",
                        f"{slot} has qk_rope_head_dim={cfg.qk_rope_head_dim} but the shared rope tables "
                        f"are {rope_dim} wide")

    def default_slots(self) -> dict[str, Config]:
        slots = super().default_slots()
        for i in range(self.n_layers):
            if not self.is_moe_layer(i):
                slots[f"layers.{i}.feed_forward"] = self.dense_feed_forward
        for k in range(self.n_mtp):
            p = f"mtp.{k}"
            slots[f"{p}.enorm"] = self.norm
            slots[f"{p}.hnorm"] = self.norm
            slots[f"{p}.block.attention_norm"] = self.norm
            slots[f"{p}.block.attention"] = self.attention
            slots[f"{p}.block.ffn_norm"] = self.norm
            slots[f"{p}.block.feed_forward"] = self.feed_forward  # MTP layers are MoE (as HF's get_mtp_config)
            slots[f"{p}.norm"] = self.norm
        return slots

    def slots(self) -> dict[str, Config]:
        """Slots with overrides applied; MLA slots with ``softmax_mscale=0`` take the rope's value."""
        mscale = softmax_mscale_of(self.rope)
        resolved = {}
        for path, cfg in super().slots().items():
            if isinstance(cfg, MLAConfig) and not cfg.softmax_mscale:
                cfg = dataclasses.replace(cfg, softmax_mscale=mscale)
            resolved[path] = cfg
        return resolved

    def build(self) -> "DeepSeekV3Transformer":
        return DeepSeekV3Transformer(self)


def deepseek_v3_config(
    flavor: str,
    *,
    q_lora_rank: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    n_experts: int,
    top_k: int,
    moe_ffn_dim: int,
    n_shared_experts: int = 1,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 2.5,
    norm_topk_prob: bool = True,
    bias_update_speed: float = 0.0,
    seq_aux_loss_coef: float = 0.0,
    rope: RopeConfig | None = None,
    family: str = "deepseek_v3",
    **sizes,
) -> DeepSeekV3Config:
    """A DeepSeek-V3-style config from HF-like hyperparameters (n_kv_heads = n_heads, head_dim = rope width)."""
    attention = MLAConfig(q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                          qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim)
    moe = MoEConfig(n_routed_experts=n_experts, n_activated=top_k, moe_ffn_dim=moe_ffn_dim,
                    n_shared_experts=n_shared_experts, score_func="sigmoid", norm_topk_prob=norm_topk_prob,
                    routed_scaling_factor=routed_scaling_factor, n_group=n_group, topk_group=topk_group,
                    bias_update_speed=bias_update_speed, seq_aux_loss_coef=seq_aux_loss_coef)
    sizes.setdefault("norm_eps", 1e-6)
    sizes.setdefault("n_kv_heads", sizes["n_heads"])
    return DeepSeekV3Config(family=family, flavor=flavor, head_dim=qk_rope_head_dim, attention=attention,
                            feed_forward=moe, rope=rope or YarnRopeConfig(scaling="none"), **sizes)


class MTPLayer(nn.Module):
    """One MTP depth: proj([enorm(emb); hnorm(h)]) -> block -> norm (head shared with the model)."""

    def __init__(self, config: DeepSeekV3Config, slots: dict[str, Config], prefix: str) -> None:
        super().__init__()
        dim, eps = config.dim, config.norm_eps
        self.enorm = slots[f"{prefix}.enorm"].build(dim=dim, eps=eps)
        self.hnorm = slots[f"{prefix}.hnorm"].build(dim=dim, eps=eps)
        self.proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = TransformerBlock(config, slots, f"{prefix}.block")
        self.norm = slots[f"{prefix}.norm"].build(dim=dim, eps=eps)

    def forward(self, emb: torch.Tensor, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: Any = None) -> torch.Tensor:
        """``cache``: this depth's layer cache when the engine drafts with it (lockstep.generate.speculative)."""
        x = self.proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return self.norm(self.block(x, rope, cache=cache))


class DeepSeekV3Transformer(Transformer):
    """The shared decoder plus ``mtp`` (a ModuleDict of MTPLayer, absent when ``n_mtp == 0``)."""

    config: DeepSeekV3Config

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__(config)
        slots = config.slots()
        self.mtp = (
            nn.ModuleDict({str(k): MTPLayer(config, slots, f"mtp.{k}") for k in range(config.n_mtp)})
            if config.n_mtp else None
        )
        self._mtp_losses: list[torch.Tensor] = []
        #: set from outside by context parallelism (each rank holds part of every sequence): supplies
        #: each depth's shifted tokens and targets for this rank's positions (``mtp_shift``) and the
        #: loss as this rank's part of the whole-sequence mean (``cross_entropy``); None in one process
        self.mtp_context = None
        self._mtp_values: list[torch.Tensor] = []  # under mtp_context: the whole-sequence per-depth losses

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        positions, emb, h = self.trunk(tokens, positions)
        self._mtp_losses = []
        if self.mtp is not None and self.training and self.config.mtp_loss_weight > 0:
            if self.mtp_context is None:
                self._mtp_losses = [
                    F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                    for logits, targets in self._mtp_predict(tokens, positions, emb, h)
                ]
            else:  # (this rank's part, whole-sequence value) per depth
                parts = [self.mtp_context.cross_entropy(logits, targets)
                         for logits, targets in self._mtp_predict(tokens, positions, emb, h)]
                self._mtp_losses = [part for part, _ in parts]
                self._mtp_values = [value for _, value in parts]
        return self.output(h)

    def mtp_predictions(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(logits [B, T-k-1, V], targets [B, T-k-1])`` of each MTP depth k = 1..n_mtp, in any mode:
        depth k's row i predicts ``tokens[:, i+k+1]`` from ``tokens[:, :i+k+1]``."""
        if self.mtp is None:
            return []
        positions, emb, h = self.trunk(tokens, positions)
        return self._mtp_predict(tokens, positions, emb, h)

    def _mtp_predict(self, tokens: torch.Tensor, positions: torch.Tensor, emb: torch.Tensor,
                     h: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        seq = tokens.shape[1]
        out = []
        for k, layer in enumerate(self.mtp.values(), start=1):
            if self.mtp_context is not None:  # every local position; targets past the end are ignored
                shifted, targets, shifted_positions = self.mtp_context.mtp_shift(tokens, positions, k)
                h = layer(self.tok_embeddings(shifted), h, self.rope(shifted_positions))
                out.append((self.output(h), targets))
                continue
            n = seq - k - 1  # positions i < n have their target t_{i+k+1} inside the inputs
            if n <= 0:
                break
            h = layer(emb[:, k:k + n], h[:, :n], self.rope(positions[..., k:k + n]))
            out.append((self.output(h), tokens[:, k + 1:k + 1 + n]))
        return out

    def pop_auxiliary(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | float]]:
        losses, metrics = super().pop_auxiliary()
        if self._mtp_losses:
            depth = self.config.n_mtp  # DeepSeek-V3: lambda / D * sum_k L_k
            losses["mtp/loss"] = self.config.mtp_loss_weight * torch.stack(self._mtp_losses).sum() / depth
            # tensors, not floats: the step reduces its scalars once (no host sync per micro-batch)
            values = self._mtp_values or self._mtp_losses
            metrics.update({f"mtp/loss_{k}": v.detach() for k, v in enumerate(values, start=1)})
        self._mtp_losses, self._mtp_values = [], []
        return losses, metrics

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token counting *activated* experts, MLA's q.k/p.v widths and MTP.

        Matmul parameters: 6 x (per block: attention and dense weights, or the router plus the k
        routed and the shared experts of a MoE; the output head once per prediction depth).
        Attention per block: 3 x n_heads x (qk + v head dims) x seq_len (causal average, forward and
        backward). MTP depths count at full length when their loss is computed (weight > 0).
        """
        cfg = self.config
        use_mtp = self.mtp is not None and cfg.mtp_loss_weight > 0
        blocks = list(self.layers.values())
        matmul = 0
        if use_mtp:
            blocks += [layer.block for layer in self.mtp.values()]
            matmul += sum(layer.proj.weight.numel() for layer in self.mtp.values())
        attn = 0
        for block in blocks:
            ffn = block.feed_forward
            if hasattr(ffn, "active_matmul_params"):
                matmul += ffn.active_matmul_params()
            else:
                matmul += sum(p.numel() for p in ffn.parameters() if p.dim() > 1)
            a = block.attention
            matmul += sum(p.numel() for n, p in a.named_parameters() if p.dim() > 1)
            qk = getattr(a, "qk_head_dim", getattr(a, "head_dim", cfg.resolved_head_dim))
            attn += 3 * a.n_heads * (qk + getattr(a, "v_head_dim", qk)) * seq_len
        heads = 1 + (cfg.n_mtp if use_mtp else 0)
        return 6 * (matmul + heads * self.output.weight.numel()) + attn


def mla_param_count(dim: int, n_heads: int, mla: MLAConfig) -> int:
    """Weights of one MLA block (without biases), for quick size checks of real-shape configs."""
    q = (dim * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * n_heads * mla.qk_head_dim
         if mla.q_lora_rank else dim * n_heads * mla.qk_head_dim)
    kv = dim * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
    kv += mla.kv_lora_rank * n_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv + n_heads * mla.v_head_dim * dim


def param_count(config: DeepSeekV3Config) -> dict[str, int]:
    """Total and per-token-active parameters of a config, computed without building it."""
    if not isinstance(config.attention, MLAConfig):
        raise ValueError("param_count expects MLA attention")
    d = config.dim
    attn = mla_param_count(d, config.n_heads, config.attention)
    dense_ffn = 3 * d * config.ffn_dim
    moe = config.feed_forward
    total_moe = active_moe = 0
    if isinstance(moe, MoEConfig):
        f = moe.moe_ffn_dim or config.ffn_dim
        shared = 3 * d * f * moe.n_shared_experts
        total_moe = moe.n_routed_experts * 3 * d * f + shared + moe.n_routed_experts * d
        active_moe = moe.n_activated * 3 * d * f + shared + moe.n_routed_experts * d
    n_dense = min(config.first_k_dense_replace, config.n_layers)
    n_moe = config.n_layers - n_dense
    norms = config.n_layers * 2 * d + d
    emb = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    layers_total = config.n_layers * attn + n_dense * dense_ffn + n_moe * total_moe + norms
    layers_active = config.n_layers * attn + n_dense * dense_ffn + n_moe * active_moe + norms
    mtp = config.n_mtp * (attn + total_moe + 2 * d * d + 5 * d)
    return {"total": layers_total + emb + mtp, "active": layers_active + emb, "mtp": mtp,
            "embedding": emb, "attention_per_layer": attn, "moe_per_layer": total_moe}


__all__ = ["DeepSeekV3Config", "DeepSeekV3Transformer", "MTPLayer", "deepseek_v3_config", "mla_param_count",
           "param_count"]
