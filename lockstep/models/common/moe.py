"""Dropless mixture-of-experts feed-forward (Qwen3-MoE, DeepSeek-V3 routing) with grouped experts.

A ``MoEConfig`` builds a :class:`MoE`: a router (``gate`` Linear plus the DeepSeek-V3
``e_score_correction_bias`` buffer), ``n_routed_experts`` SwiGLU experts held as stacked weights
``[E, ...]`` and computed grouped (tokens sorted by expert, one matmul per contiguous slice, via
``torch._grouped_mm`` where it is used, else a loop over experts), plus optional shared experts.
No token is ever dropped: every expert takes all the tokens routed to it.

Where the routing weights go: on the bias-free ``torch._grouped_mm`` path of a plain
:class:`GroupedExperts` (one process, not batch-invariant) each row's routing weight scales its
``[F]`` activation before the down projection, ``(w * act) @ w2.T``; elsewhere (loop, biases,
expert- or tensor-parallel experts, batch-invariant mode) it scales the ``[D]`` output,
``w * (act @ w2.T)``, as transformers does. Mathematically equal; the roundings differ (a few ulps;
tests/models/moe/test_moe_fast_path.py bounds it), and the folded form saves passes over
``[rows, D]`` tensors forward and backward (CPU train step ~4% faster, docs/benchmarks.md).

Each forward records expert-load metrics (and the weighted sequence balance loss when enabled) that
``Transformer.pop_auxiliary`` collects.

Aux-loss-free balancing (``bias_update_speed > 0``) moves the selection bias once per optimizer
step, never inside a forward: a training-mode forward only adds its per-expert token counts to
a pending total (eval forwards add nothing), and :func:`apply_routing_updates` (called by
``Transformer.after_optimizer_step`` after each optimizer step) sums them over data-parallel ranks
(``MoE.reduce_counts``), takes one sign step and clears them. The counts of all micro-batches of a
step are pooled (with one micro-batch per step this is exactly the former per-forward update). So
the bias is constant within a step and an activation checkpoint's recompute routes every token as
its forward did; the recompute (a forward run inside backward) adds no counts and records nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from lockstep import numerics
from lockstep.config.base import require, require_choice, require_positive
from lockstep.graph.state import is_capturing
from lockstep.models.common.mlp import FeedForwardConfig, SwiGLU, clamped_swiglu
from lockstep.models.common.moe_routing import (
    balance_bias_update,
    forced_balanced_indices,
    load_stats,
    route,
    sequence_balance_loss,
)
from lockstep.models.common.moe_rows import GatherCast, mask_tail, pad_groups, pad_positions, row_experts

SCORE_FUNCS = ["softmax", "sigmoid", "topk_softmax"]
ACTIVATIONS = ["silu", "clamped_swiglu"]
ROUTINGS = ["learned", "forced_balanced"]
EXPERT_IMPLS = ["auto", "grouped_mm", "loop"]


@dataclasses.dataclass(kw_only=True)
class MoEConfig(FeedForwardConfig):
    """Top-k routed SwiGLU experts (+ optional shared experts); dropless."""

    #: number of routed experts E
    n_routed_experts: int = 8
    #: experts each token is routed to (top-k)
    n_activated: int = 2
    #: hidden size of each expert's SwiGLU; 0 uses the model's dense ffn_dim
    moe_ffn_dim: int = 0
    #: shared experts, always applied, fused into one SwiGLU of hidden size moe_ffn_dim * n_shared_experts
    n_shared_experts: int = 0
    #: hidden size of the fused shared-expert SwiGLU; 0 means moe_ffn_dim * n_shared_experts
    shared_ffn_dim: int = 0
    #: scale the shared experts' output by sigmoid(w . x) per token (Qwen2-MoE / Qwen3-Next / Qwen3.5)
    shared_expert_gate: bool = False
    #: router affinity: "softmax" over experts (Qwen3-MoE), per-expert "sigmoid" (DeepSeek-V3), or
    #: "topk_softmax" (GPT-OSS: top-k logits, softmax over those k; norm_topk_prob does not apply)
    score_func: str = "softmax"
    #: the router Linear has a bias (GPT-OSS)
    router_bias: bool = False
    #: each expert's projections have biases (GPT-OSS)
    expert_bias: bool = False
    #: expert activation: "silu" (SwiGLU) or "clamped_swiglu" (GPT-OSS, with swiglu_alpha / swiglu_limit)
    activation: str = "silu"
    #: clamped_swiglu: sigmoid gain
    swiglu_alpha: float = 1.702
    #: clamped_swiglu: clamp of the gate (above) and of the up projection (both sides)
    swiglu_limit: float = 7.0
    #: renormalise the chosen k weights to sum to 1 (before routed_scaling_factor)
    norm_topk_prob: bool = True
    #: multiply the routed experts' weights by this (DeepSeek-V3 uses 2.5)
    routed_scaling_factor: float = 1.0
    #: expert groups for group-limited routing (DeepSeek-V3: 8); 1 disables
    n_group: int = 1
    #: groups each token may pick experts from (must be <= n_group)
    topk_group: int = 1
    #: aux-loss-free balancing: step of the sign-based selection-bias update, one per optimizer step
    #: from the expert load of all that step's micro-batches; 0 disables
    bias_update_speed: float = 0.0
    #: weight of the DeepSeek-V3 sequence-wise balance loss (added to the training loss); 0 disables
    seq_aux_loss_coef: float = 0.0
    #: "learned" (router decides) or "forced_balanced" (round-robin, weights 1/k; benchmarking only)
    routing: str = "learned"
    #: expert matmuls: "grouped_mm" (torch._grouped_mm), "loop" (one matmul per expert), or "auto"
    #: (grouped_mm on CPU where it is checked against the loop, loop on other devices)
    experts_impl: str = "auto"

    def validate(self, path: str = "") -> None:
        p = f"{path}." if path else ""
        require_positive(self.n_routed_experts, f"{p}n_routed_experts")
        require(
            1 <= self.n_activated <= self.n_routed_experts,
            f"{p}n_activated",
            f"must be in [1, n_routed_experts={self.n_routed_experts}], got {self.n_activated}",
        )
        require(self.moe_ffn_dim >= 0, f"{p}moe_ffn_dim", f"must be >= 0, got {self.moe_ffn_dim}")
        require(self.n_shared_experts >= 0, f"{p}n_shared_experts", f"must be >= 0, got {self.n_shared_experts}")
        require(self.shared_ffn_dim >= 0, f"{p}shared_ffn_dim", f"must be >= 0, got {self.shared_ffn_dim}")
        require(not self.shared_expert_gate or self.n_shared_experts > 0, f"{p}shared_expert_gate",
                "needs n_shared_experts > 0")
        require_choice(self.score_func, SCORE_FUNCS, f"{p}score_func")
        require_choice(self.routing, ROUTINGS, f"{p}routing")
        require_choice(self.experts_impl, EXPERT_IMPLS, f"{p}experts_impl")
        require_choice(self.activation, ACTIVATIONS, f"{p}activation")
        if self.activation == "clamped_swiglu":
            require_positive(self.swiglu_limit, f"{p}swiglu_limit")
        if self.score_func == "topk_softmax":
            require(self.n_group == 1, f"{p}n_group", "group-limited routing is not defined for topk_softmax")
        require_positive(self.routed_scaling_factor, f"{p}routed_scaling_factor")
        require_positive(self.n_group, f"{p}n_group")
        require(
            self.n_routed_experts % self.n_group == 0,
            f"{p}n_group",
            f"must divide n_routed_experts={self.n_routed_experts}, got {self.n_group}",
        )
        require(
            1 <= self.topk_group <= self.n_group,
            f"{p}topk_group",
            f"must be in [1, n_group={self.n_group}], got {self.topk_group}",
        )
        if self.n_group > 1:
            reachable = self.topk_group * (self.n_routed_experts // self.n_group)
            require(
                self.n_activated <= reachable,
                f"{p}topk_group",
                f"topk_group={self.topk_group} groups hold {reachable} experts, fewer than n_activated={self.n_activated}",
            )
        require(self.bias_update_speed >= 0, f"{p}bias_update_speed", f"must be >= 0, got {self.bias_update_speed}")
        require(self.seq_aux_loss_coef >= 0, f"{p}seq_aux_loss_coef", f"must be >= 0, got {self.seq_aux_loss_coef}")

    def build(self, *, dim: int, hidden_dim: int, init_std: float = 0.02, out_init_std: float | None = None) -> "MoE":
        """``hidden_dim`` is the model's dense ffn size (used only when moe_ffn_dim is 0).

        ``init_std`` / ``out_init_std`` set the normal init of the expert input and output
        projections; the transformer does not pass them yet, so they default to 0.02 (both).
        """
        self.validate()
        return MoE(self, dim, self.moe_ffn_dim or hidden_dim, init_std, out_init_std)


def resolve_impl(impl: str, device: torch.device) -> str:
    """The expert implementation ``impl`` ("auto", "grouped_mm", "loop") means on ``device``."""
    if impl != "auto":
        return impl
    return "grouped_mm" if device.type == "cpu" and hasattr(torch, "_grouped_mm") else "loop"


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm's backward rejects stride-0 (expanded) grads, e.g. from a plain .sum().
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


#: On CPU, reduced-precision ``torch._grouped_mm`` runs one oneDNN matmul per expert, and oneDNN JIT-builds
#: (~1 ms each) a primitive for every new row count; routing changes after each optimizer step, so an
#: unpadded model rebuilt hundreds of them per step (~0.5 s of CPU in a tiny model). Padding each
#: expert's rows to a multiple of this keeps the set of shapes small, so they stay cached.
_CPU_ROW_BUCKET = 32


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass: an activation checkpoint's recompute (both
    ``torch.utils.checkpoint`` implementations recompute from autograd's engine, which is the only
    place a graph task is active; a test pins this for each)."""
    return torch._C._current_graph_task_id() != -1


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from lockstep.ops.batch_invariant import linear

    return linear(x, weight)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: ``w1, w3 [E, F, D]`` and ``w2 [E, D, F]`` (Linear layout)."""

    #: whether ``forward`` may take the routing (gather + weights): see :meth:`fuses_routing`
    takes_routing: bool = True

    def __init__(self, n_experts: int, dim: int, hidden_dim: int, impl: str = "auto",
                 init_std: float = 0.02, out_init_std: float | None = None, bias: bool = False,
                 activation=None) -> None:
        super().__init__()
        self.n_experts, self.dim, self.hidden_dim, self.impl = n_experts, dim, hidden_dim, impl
        self.init_std = init_std
        self.out_init_std = init_std if out_init_std is None else out_init_std
        #: ``activation(gate, up)``; None: SwiGLU's silu(gate) * up
        self.activation = activation
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        # biases of w1 / w3 / w2, per expert (GPT-OSS)
        self.b1 = nn.Parameter(torch.empty(n_experts, hidden_dim)) if bias else None
        self.b3 = nn.Parameter(torch.empty(n_experts, hidden_dim)) if bias else None
        self.b2 = nn.Parameter(torch.empty(n_experts, dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, mean=0.0, std=self.init_std)
        nn.init.normal_(self.w3, mean=0.0, std=self.init_std)
        nn.init.normal_(self.w2, mean=0.0, std=self.out_init_std)
        for b in (self.b1, self.b3, self.b2):
            if b is not None:
                nn.init.zeros_(b)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.activation is None:
            return numerics.rowwise(F.silu, gate) * up
        return self.activation(gate, up)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w1, w2, w3)`` as this process computes with them (an expert-tensor-parallel subclass
        returns its local shards of the hidden dim)."""
        return self.w1, self.w2, self.w3

    def local_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(b1, b3, b2)`` as this process adds them (None without biases); an expert-tensor-parallel
        plan (:mod:`lockstep.parallel.tp_blocks`) replaces this on the instance: its hidden-dim shard of
        b1 / b3, and b2 on one rank only (each rank's output is a partial sum)."""
        return self.b1, self.b3, self.b2

    def forward(self, x: torch.Tensor, counts: torch.Tensor, row_weights: torch.Tensor | None = None,
                token: torch.Tensor | None = None) -> torch.Tensor:
        """``x [N, D]`` sorted by expert, ``counts [E]`` tokens per expert -> ``[N, D]``.

        Only where :meth:`fuses_routing`: ``row_weights [N]`` scale each row's output, applied to the
        activation before the down projection; with ``token [N]``, ``x`` is the unsorted input and
        row ``i`` is ``x[token[i]]`` (gathered, cast and padded in one pass). See
        :meth:`MoE.routed_and_shared`."""
        if (row_weights is not None or token is not None) and not self.fuses_routing():
            raise ValueError("row_weights / token: only the bias-free grouped_mm path takes the routing")
        if numerics.is_batch_invariant():  # each expert's rows in fixed tiles (lockstep.ops.batch_invariant)
            return self._loop(x, counts, invariant_linear)
        if resolve_impl(self.impl, x.device) == "grouped_mm":
            return self._grouped_mm(x, counts, row_weights, token)
        return self._loop(x, counts)

    def fuses_routing(self) -> bool:
        """Whether ``forward`` takes ``row_weights`` and ``token``: the bias-free ``torch._grouped_mm``
        path of this class (subclasses for expert / tensor parallelism set ``takes_routing = False``:
        they keep the dispatch and the weighted combine outside). A class test would be wrong here:
        FSDP2 swaps a sharded module's class for a generated subclass, and its forward is this one."""
        return (self.takes_routing and self.b1 is None and not numerics.is_batch_invariant()
                and resolve_impl(self.impl, self.w1.device) == "grouped_mm")

    def _grouped_mm(self, x: torch.Tensor, counts: torch.Tensor, row_weights: torch.Tensor | None = None,
                    token: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):  # _grouped_mm is not on autocast's cast lists
            dtype = torch.get_autocast_dtype(x.device.type)
        rows = None
        pad = x.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
        if token is not None and pad and not is_capturing():
            counts, rows, total = pad_positions(counts, _CPU_ROW_BUCKET, token.shape[0])
            src = token.new_full((total,), x.shape[0]).index_copy(0, rows, token)
            x = GatherCast.apply(x, src, dtype)
        else:
            x = (x if token is None else x.index_select(0, token)).to(dtype)
            if pad:
                x, counts, rows = pad_groups(x, counts, _CPU_ROW_BUCKET)
        if row_weights is not None and rows is not None:  # padding rows weigh 0
            row_weights = row_weights.new_zeros(x.shape[0]).index_copy(0, rows, row_weights)
        offs = counts.cumsum(0).to(torch.int32)
        padded = rows is not None
        w1, w2, w3 = (w.to(dtype) for w in self.local_weights())
        gate = _contiguous_grad(torch._grouped_mm(x, w1.mT, offs=offs))
        up = _contiguous_grad(torch._grouped_mm(x, w3.mT, offs=offs))
        if self.b1 is None:
            act = self._act(mask_tail(gate, offs, padded), mask_tail(up, offs, padded))
            if row_weights is not None:
                act = act * row_weights.unsqueeze(1).to(dtype)
            out = _contiguous_grad(torch._grouped_mm(act, w2.mT, offs=offs))
            return out if rows is None else out[rows]
        expert = row_experts(counts, offs, x.shape[0], padded)  # each row's expert
        b1, b3, b2 = self.local_biases()
        # masked after the bias: the tail's (unwritten) gradients must not reach the bias gradients
        gate = mask_tail(gate + b1.to(dtype)[expert], offs, padded)
        up = mask_tail(up + b3.to(dtype)[expert], offs, padded)
        out = mask_tail(_contiguous_grad(torch._grouped_mm(self._act(gate, up), w2.mT, offs=offs)), offs, padded)
        out = out + b2.to(dtype)[expert]
        return out if rows is None else out[rows]

    def _loop(self, x: torch.Tensor, counts: torch.Tensor, linear=F.linear) -> torch.Tensor:
        outs = []
        w1, w2, w3 = self.local_weights()
        b1, b3, b2 = self.local_biases()
        for e, chunk in enumerate(x.split(counts.tolist())):
            if not chunk.shape[0]:
                continue
            gate, up = linear(chunk, w1[e]), linear(chunk, w3[e])
            if self.b1 is None:
                outs.append(linear(self._act(gate, up), w2[e]))
            else:
                outs.append(linear(self._act(gate + b1[e], up + b3[e]), w2[e]) + b2[e])
        return torch.cat(outs) if outs else x.new_zeros(0, self.dim)


class MoE(nn.Module):
    """Routed experts (+ shared experts) over ``[..., D]`` tokens; see the module docstring."""

    def __init__(self, config: MoEConfig, dim: int, hidden_dim: int,
                 init_std: float = 0.02, out_init_std: float | None = None) -> None:
        super().__init__()
        self.config = config
        self.n_experts, self.top_k = config.n_routed_experts, config.n_activated
        #: read by the run manifest: "learned" or "forced_balanced"
        self.routing_mode = config.routing
        #: set from outside by a parallel plan: sums expert counts over ranks that see other tokens,
        #: so replicated routers take the same bias step (the model itself knows no process groups)
        self.reduce_counts = None
        #: set from outside by context parallelism (each rank holds part of every sequence): the
        #: sequence balance loss as this rank's part of the whole sequences' loss, same signature as
        #: :func:`sequence_balance_loss` (the one-process loss when None)
        self.sequence_loss = None
        #: set from outside by a tensor-parallel plan that splits each expert's hidden dim (each rank
        #: computes a partial sum of the experts' outputs): applied to the tokens and the routing
        #: weights entering that partial computation; identity forward, sums their gradients over
        #: the tensor-parallel ranks. None in one process.
        self.tp_region = None
        #: tokens per expert of this optimizer step's training forwards so far (int64 [E]), not yet applied
        self.pending_counts: torch.Tensor | None = None
        self.gate = nn.Linear(dim, self.n_experts, bias=config.router_bias)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))
        act = (functools.partial(clamped_swiglu, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
               if config.activation == "clamped_swiglu" else None)
        self.experts = GroupedExperts(self.n_experts, dim, hidden_dim, config.experts_impl, init_std, out_init_std,
                                      bias=config.expert_bias, activation=act)
        self.shared_experts = (
            SwiGLU(dim, config.shared_ffn_dim or hidden_dim * config.n_shared_experts)
            if config.n_shared_experts else None
        )
        self.shared_expert_gate = (
            nn.Linear(dim, 1, bias=False) if config.n_shared_experts and config.shared_expert_gate else None
        )
        self._losses: dict[str, torch.Tensor] = {}
        self._stats: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        """Zero the selection bias (gate, experts and shared experts initialise themselves)."""
        nn.init.zeros_(self.e_score_correction_bias)
        self.pending_counts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n_tokens, cfg = flat.shape[0], self.config
        with torch.autocast(x.device.type, enabled=False):  # routing in fp32, as DeepSeek-V3 does
            logits = numerics.linear(flat.float(), self.gate.weight.float())
            if self.gate.bias is not None:
                logits = logits + self.gate.bias.float()
        if cfg.routing == "forced_balanced":
            indices = forced_balanced_indices(n_tokens, self.top_k, self.n_experts, flat.device)
            # Uniform 1/k weights; the gate still runs and joins the graph with a zero gradient, so
            # the benchmark pays the router's cost and no parameter is left unused (DDP/FSDP).
            weights = torch.full(indices.shape, 1.0 / self.top_k, device=flat.device) + 0.0 * logits.sum()
            scores = None
        else:
            weights, indices, scores = route(
                logits, top_k=self.top_k, score_func=cfg.score_func, norm_topk_prob=cfg.norm_topk_prob,
                routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group,
                topk_group=cfg.topk_group, bias=self.e_score_correction_bias,
            )
        counts = torch.bincount(indices.reshape(-1), minlength=self.n_experts)
        expert_in = flat if self.tp_region is None else self.tp_region(flat)
        if self.tp_region is not None:
            weights = self.tp_region(weights)
        out = self.routed_and_shared(flat, expert_in, weights, indices, counts)
        self._record(counts, scores, indices, shape)
        return out.view(shape)

    def routed_and_shared(self, flat: torch.Tensor, expert_in: torch.Tensor, weights: torch.Tensor,
                          indices: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum plus the shared experts, for ``flat [N, D]`` routed to
        ``indices [N, k]`` with ``weights [N, k]`` (``expert_in``: the experts' input, ``flat`` unless
        a tensor-parallel region wraps it). Expert parallelism's Dist-MoE operation overrides this
        (:mod:`lockstep.parallel.dist_moe`)."""
        order = indices.reshape(-1).argsort(stable=True)
        token = order // self.top_k
        row_weights = weights.reshape(-1)[order]
        if self.experts.fuses_routing():
            # gather and weights inside the experts: the weights scale the [rows, F] activation, not
            # the [rows, D] output (on CPU each pass over a [rows, D] tensor costs: the layer is bound
            # by memory traffic between its GEMMs); same products, rounded in another order (module
            # docstring); the gather is bitwise the plain one
            routed = self.experts(expert_in, counts, row_weights=row_weights, token=token)
        else:
            routed = self.experts(expert_in[token], counts)
            routed = routed * row_weights.unsqueeze(1).to(routed.dtype)
        out = torch.zeros_like(flat).index_add_(0, token, routed.to(flat.dtype))
        shared = self.shared_output(flat)
        return out if shared is None else out + shared

    def shared_output(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output for ``flat [N, D]`` (gated when configured); None without them."""
        if self.shared_experts is None:
            return None
        shared = self.shared_experts(flat)
        if self.shared_expert_gate is not None:
            shared = numerics.rowwise(torch.sigmoid, self.shared_expert_gate(flat)) * shared
        return shared

    def _record(self, counts: torch.Tensor, scores: torch.Tensor | None, indices: torch.Tensor,
                shape: torch.Size) -> None:
        cfg = self.config
        losses: dict[str, torch.Tensor] = {}
        learned = scores is not None and self.training
        if learned and cfg.seq_aux_loss_coef > 0:
            # computed in a recompute too: a non-reentrant checkpoint recomputes the tensors this
            # loss's backward saved, and expects the same ops in the same order
            seq = shape[-2] if len(shape) >= 3 else shape[0]
            b = scores.shape[0] // seq
            loss_fn = self.sequence_loss or sequence_balance_loss
            loss = loss_fn(scores.view(b, seq, -1), indices.view(b, seq, -1), self.n_experts, self.top_k)
            losses["seq_aux_loss"] = cfg.seq_aux_loss_coef * loss
        if _recomputing():  # the forward already recorded this micro-batch
            return
        self._stats = load_stats(counts).detach()
        self._losses = losses
        if learned and cfg.bias_update_speed > 0:
            self.pending_counts = counts if self.pending_counts is None else self.pending_counts + counts

    @torch.no_grad()
    def apply_routing_update(self) -> None:
        """One aux-loss-free bias step from the counts pooled since the last call, then clear them.

        With ``reduce_counts`` set (data parallelism) this is a collective: every rank of that group
        must call it, in the same module order, also a rank that ran no training forward.
        """
        cfg = self.config
        counts, self.pending_counts = self.pending_counts, None
        if cfg.bias_update_speed <= 0 or cfg.routing != "learned":
            return
        if counts is None:
            if self.reduce_counts is None:
                return  # nothing observed here and no other rank to hear from: no step
            counts = torch.zeros(self.n_experts, dtype=torch.int64, device=self.e_score_correction_bias.device)
        if self.reduce_counts is not None:
            counts = self.reduce_counts(counts)
        balance_bias_update(self.e_score_correction_bias, counts, cfg.bias_update_speed)

    def pop_auxiliary(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | float]]:
        """Losses (``seq_aux_loss``, already weighted, when enabled in training) and metrics of the
        last forward: ``load_min`` / ``load_max`` (token assignments per expert, k per token),
        ``load_cv`` (std/mean of those; 0 = balanced), ``dropped_tokens`` (always 0: dropless), and
        ``bias_absmax`` (largest selection bias) when aux-loss-free balancing is on. Clears them.

        The metrics are detached 0-d tensors on the model's device (``dropped_tokens`` a float):
        nothing is read back to the host per forward; ``StepScalars`` turns a step's sums into
        numbers once."""
        if self._stats is None:
            return {}, {}
        lo, hi, cv = self._stats.unbind()
        metrics: dict[str, torch.Tensor | float] = {"load_min": lo, "load_max": hi, "load_cv": cv,
                                                   "dropped_tokens": 0.0}
        if self.config.bias_update_speed > 0:
            metrics["bias_absmax"] = self.e_score_correction_bias.detach().abs().max()
        losses, self._losses, self._stats = self._losses, {}, None
        return losses, metrics

    def active_matmul_params(self) -> int:
        """Matmul parameters one token uses (gate, k routed experts, shared experts): the MoE
        analogue of a dense layer's parameter count for 6N FLOP estimates."""
        per_expert = self.experts.w1[0].numel() * 3
        shared = sum(p.numel() for p in self.shared_experts.parameters()) if self.shared_experts else 0
        if self.shared_expert_gate is not None:
            shared += self.shared_expert_gate.weight.numel()
        return self.gate.weight.numel() + self.top_k * per_expert + shared


def apply_routing_updates(module: nn.Module) -> None:
    """Apply the pending aux-loss-free bias step of every MoE layer under ``module``: call it once after
    each optimizer step (``Transformer.after_optimizer_step`` does). Walks any module tree (a model,
    an FSDP-wrapped model, a pipeline rank's ``nn.ModuleList`` of stages); a no-op without MoE
    layers. A collective under data parallelism: every data-parallel rank must call it."""
    for sub in module.modules():
        if isinstance(sub, MoE):
            sub.apply_routing_update()
