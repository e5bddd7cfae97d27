"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2): per-query top-k key selection for MLA.

The indexer scores every (query t, key s) pair cheaply and keeps each query's ``topk`` best keys;
the main attention (:class:`lockstep.models.common.mla.MultiHeadLatentAttention`, which owns one
indexer when ``MLAConfig.indexer`` is set) then attends only over those keys (and, as always, only
causally). As transformers' ``DeepseekV32Indexer`` (whose weights and names this follows):

* queries ``q = wq_b(q_latent)`` (``[T, n_heads, head_dim]``, from MLA's normalised query latent
  ``q_norm(wq_a(x))``), one key per token ``k = k_norm(wk(x))`` (a LayerNorm; ``head_dim`` wide,
  shared by the heads), per-head weights ``w = weights_proj(x) / sqrt(n_heads)``;
* RoPE on the *first* ``rope_dim`` dims of q and k, in the half-rotation layout (not MLA's
  interleaved one), with the model's rope tables;
* ``I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(head_dim))`` in fp32; keys after the
  query get ``-inf``; the selection is the ``min(topk, S)`` best keys. The released model's Hadamard
  rotation and fp8 scoring are skipped (the rotation is orthogonal; fp8 is a precision choice).

Exact ties are common (a key every head scores below zero scores exactly 0 after the relu):
among tied keys the earliest positions win (a stable sort), so a query selects the same keys in a
training forward and in any generation step, however long its padded context row. transformers'
``topk`` leaves ties to the kernel, which may break them differently at different row lengths
(its prefill and its decode steps); where a tie straddles the top-k boundary the two may differ.

The selection is a boolean mask ``keep [B, 1, T, S]`` = causal and selected. With ``topk >= S``
every causal key is kept (no top-k is run). Generation caches the indexer's keys beside MLA's
latent (:meth:`lockstep.generate.cache.LayerCache.gather_index_keys`).

Training signal (DeepSeek-V3.2 paper, section 2.1; transformers runs the indexer under
``no_grad`` and has no such loss). The indexer's input is detached, so the language-model loss
never reaches the indexer (the top-k is not differentiable either) and the indexer loss never
reaches the main model. With ``loss_weight > 0``, in training mode, the indexer records

    L_I = loss_weight * mean_{b, t} KL(p[t, :] || softmax(I[t, :]))

over the keys the main attention saw at ``t`` (``stage="sparse"``: the selected set; ``"dense"``:
all causal keys), where ``p`` is the main attention's distribution summed over heads and
L1-normalised (fp32, detached). ``pop_auxiliary()`` returns it as ``kl`` (the model prefixes the
module path: ``layers.{i}.attention.indexer/kl``), which the trainer adds to the loss.
``stage="dense"`` is the paper's warm-up: the main attention stays dense while the indexer learns
to imitate it (the paper also freezes the rest of the model then; lockstep has no freezing switch,
so that part is up to the optimiser set-up). The target needs the attention
probabilities ``[B, H, T, S]``: a reference computation, sized for small models.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.config.base import Config, ConfigError, require, require_choice, require_positive
from lockstep.models.common.moe import _recomputing
from lockstep.models.common.rope import apply_rotary

STAGES = ("sparse", "dense")


@dataclasses.dataclass(kw_only=True)
class SparseIndexerConfig(Config):
    """The lightning indexer of DeepSeek Sparse Attention (module docstring)."""

    #: indexer query heads (HF ``index_n_heads``)
    n_heads: int = 64
    #: width of an indexer query head and of the shared indexer key (HF ``index_head_dim``)
    head_dim: int = 128
    #: keys kept per query (HF ``index_topk``)
    topk: int = 2048
    #: weight of the indexer's KL loss (training mode only); 0 skips computing it
    loss_weight: float = 0.0
    #: "sparse": main attention over the top-k keys; "dense": warm-up, main attention over all keys
    stage: str = "sparse"

    def validate(self, path: str = "") -> None:
        for name in ("n_heads", "head_dim", "topk"):
            require_positive(getattr(self, name), f"{path}.{name}")
        require(self.loss_weight >= 0, f"{path}.loss_weight", f"must be >= 0, got {self.loss_weight}")
        require_choice(self.stage, STAGES, f"{path}.stage")

    def build(self, *, dim: int, q_lora_rank: int, rope_dim: int) -> "SparseIndexer":
        if not q_lora_rank:
            raise ValueError("the sparse indexer reads MLA's query latent: attention.q_lora_rank must be > 0")
        if rope_dim > self.head_dim:
            raise ValueError(f"the sparse indexer rotates its first qk_rope_head_dim={rope_dim} dims: "
                             f"indexer.head_dim must be >= that, got {self.head_dim}")
        return SparseIndexer(self, dim, q_lora_rank, rope_dim)


class SparseIndexer(nn.Module):
    """x [B, T, dim], q_latent [B, T, q_lora_rank] -> index scores / keep mask (module docstring)."""

    def __init__(self, config: SparseIndexerConfig, dim: int, q_lora_rank: int, rope_dim: int) -> None:
        super().__init__()
        self.config = config
        self.n_heads, self.head_dim, self.rope_dim, self.topk = config.n_heads, config.head_dim, rope_dim, config.topk
        self.wq_b = nn.Linear(q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(dim, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim ** -0.5
        self._losses: list[torch.Tensor] = []

    @property
    def sparse(self) -> bool:
        """Whether the main attention is restricted to the selected keys (not the dense warm-up)."""
        return self.config.stage == "sparse"

    @property
    def records_loss(self) -> bool:
        return self.training and self.config.loss_weight > 0

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE (half-rotation layout) on the first ``rope_dim`` dims of ``x [B, H, T, head_dim]``."""
        rot, rest = torch.split(x, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rotary(rot, *rope), rest], dim=-1)

    def keys(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The rotated indexer key of every token, ``[B, T, head_dim]`` (what generation caches)."""
        return self._rotate(self.k_norm(self.wk(x)).unsqueeze(1), rope).squeeze(1)

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               keys: torch.Tensor) -> torch.Tensor:
        """fp32 index scores ``I [B, T, S]`` of this call's queries against ``keys [B, S, head_dim]``
        (unmasked; the op order of transformers' indexer, so the top-k agrees with it bit for bit)."""
        bsz, seq, _ = x.shape
        q = self.wq_b(q_latent).view(bsz, seq, self.n_heads, self.head_dim)
        q = self._rotate(q.transpose(1, 2), rope).transpose(1, 2)
        per_head = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale
        per_head = F.relu(per_head)  # [B, T, H, S]
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * (self.n_heads ** -0.5)
        return torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)

    def select(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``keep [B, 1, T, S]``: the allowed (causal) keys among each query's top-k by ``scores``.
        ``allowed``: boolean, broadcastable to ``[B, 1, T, S]``."""
        n_keys = scores.shape[-1]
        if self.topk >= n_keys:  # every key is selected: the mask is the causal one
            return allowed.expand(scores.shape[0], 1, *scores.shape[1:])
        masked = scores.masked_fill(~allowed[:, 0], float("-inf"))
        # a stable sort, not topk: exact ties (keys whose every head's relu is 0 score exactly 0) go to
        # the earliest keys, whatever the row's length (a cached context has padding keys at its end)
        chosen = masked.sort(dim=-1, descending=True, stable=True).indices[..., :self.topk]
        selected = torch.zeros_like(masked, dtype=torch.bool).scatter_(-1, chosen, True)
        return (selected & allowed[:, 0]).unsqueeze(1)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                allowed: torch.Tensor, keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keep [B, 1, T, S], scores [B, T, S])`` for this call's tokens. ``keys``: the context's
        indexer keys (generation; default: this call's own); ``allowed``: which keys each query may
        see (causal / cache positions). The input is detached (module docstring); the scores carry
        a gradient only while the loss is recorded."""
        x, q_latent = x.detach(), q_latent.detach()
        with torch.set_grad_enabled(self.records_loss and torch.is_grad_enabled()):
            if keys is None:
                keys = self.keys(x, rope)
            scores = self.scores(x, q_latent, rope, keys)
        return self.select(scores.detach(), allowed), scores

    def record_loss(self, scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scale: float,
                    seen: torch.Tensor) -> None:
        """Record the KL loss of ``scores [B, T, S]`` against the main attention of ``q [B, H, T, D]``
        over ``k [B, H or 1, S, D]`` restricted to ``seen [B or 1, 1, T, S]`` (module docstring)."""
        with torch.no_grad():
            logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
            probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
            target = probs.sum(1)
            target = target / target.sum(-1, keepdim=True)  # [B, T, S], L1-normalised over keys
        visible = seen[:, 0].expand_as(scores)
        log_pred = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        log_pred = log_pred.masked_fill(~visible, 0.0)  # target is 0 there: no 0 * -inf
        kl = (torch.xlogy(target, target) - target * log_pred).sum(-1)
        if not _recomputing():  # an activation checkpoint's recompute: the forward already recorded it
            self._losses.append(self.config.loss_weight * kl.mean())

    def pop_auxiliary(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | float]]:
        """The weighted KL loss of the forwards since the last call (summed), and it as a metric."""
        if not self._losses:
            return {}, {}
        loss = torch.stack(self._losses).sum()
        self._losses = []
        return {"kl": loss}, {"kl": loss.detach() / self.config.loss_weight}


def causal_allowed(seq: int, device: torch.device | str) -> torch.Tensor:
    """``[1, 1, T, T]`` boolean causal mask (key s visible to query t when s <= t)."""
    idx = torch.arange(seq, device=device)
    return (idx[None, :] <= idx[:, None])[None, None]


def refuse_batch_invariant(model: Config, batch_invariant: bool) -> None:
    """ConfigError naming ``numerics.batch_invariant`` when a model with a sparse indexer (any slot of
    ``model``, a TransformerConfig) would run batch-invariant: checked with the run's config, before any
    work (the forward refuses too, naming the op)."""
    if not batch_invariant:
        return
    refusal = getattr(model, "batch_invariant_refusal", None)  # a family whose ops have no invariant kernels
    if callable(refusal):
        raise ConfigError(f"numerics.batch_invariant: {refusal()}")
    for path, slot in model.slots().items():
        if getattr(slot, "indexer", None) is not None:
            raise ConfigError(f"numerics.batch_invariant: not supported with DeepSeek-V3.2's sparse indexer "
                              f"(model {path}.indexer; op 'sparse_indexer.topk_mask': the top-k selection feeds a "
                              "masked MLA attention the batch_invariant kernel cannot take, docs/numerics.md); "
                              "set numerics.batch_invariant=false")


def param_count(config: SparseIndexerConfig, dim: int, q_lora_rank: int) -> int:
    """Weights of one indexer (LayerNorm weight and bias included)."""
    return (q_lora_rank * config.n_heads * config.head_dim + dim * config.head_dim + 2 * config.head_dim
            + dim * config.n_heads)


__all__ = ["STAGES", "SparseIndexer", "SparseIndexerConfig", "causal_allowed", "param_count", "refuse_batch_invariant"]
