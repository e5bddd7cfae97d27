"""Expert parallelism (EP) for the grouped MoE experts, applied to a built model from outside.

``apply_expert_parallel(model, ep_group)`` keeps on each of the ``ep`` ranks only its contiguous
slice of ``E / ep`` routed experts of every MoE layer (rank r owns global experts
``[r * E/ep, (r + 1) * E/ep)``) and swaps ``MoE.experts`` for an :class:`ExpertParallelExperts`
with the same ``forward(x_sorted, counts)`` contract as :class:`GroupedExperts`:

1. ``counts [E]`` (this rank's tokens per *global* expert) are exchanged with one
   ``all_to_all_single`` so every rank learns how many rows each peer will send to each of its
   local experts;
2. the rows (already sorted by global expert, hence grouped by owning rank) go to their owners
   with an uneven ``all_to_all_single``;
3. the owner regroups what it received by local expert, runs its experts grouped, and undoes the
   regrouping;
4. a second uneven ``all_to_all_single`` sends the results back, in ``x_sorted``'s order.

Both token exchanges are autograd functions whose backward is the reverse exchange, so expert
gradients come back to the owner and input gradients to the sender.

That is the default (``parallel.ep_chunks = 0``): synchronous, each exchange sized by the counts.
With ``parallel.ep_chunks = N >= 1`` every MoE layer instead runs the routed experts as the
Dist-MoE operation (:mod:`lockstep.parallel.dist_moe`): dispatch, grouped experts and the weighted
combine over exact-split exchanges (``parallel.ep_capacity_factor`` drops past a capacity; 0 = no-drop), the batch in N
chunks whose asynchronous exchanges overlap the experts of the neighbouring chunks (and the shared
experts), forward and backward, with exposed / hidden communication, imbalance and dropped tokens
in the step metrics. The experts and everything below (gradients, state dicts) are the same. Everything else (router,
selection bias, shared experts, attention, embeddings) stays replicated: the ep ranks are
data-parallel ranks, each with its own tokens.

Gradients. After ``backward`` of each rank's *local* mean loss ``L_r``, a replicated parameter holds
``dL_r/dw`` and a local expert holds ``sum_r dL_r/dw`` (every rank's tokens routed to it). For the
global loss ``mean_r L_r``: all-reduce-average the replicated gradients over the ep group and divide
the expert gradients by ``ep`` (no communication). :func:`sync_expert_parallel_grads` does this
for plain data parallelism over the ep group. When ep borrows only part of the data-parallel ranks
(ep < dp_shard, or with dp_replicate), the ranks holding the same experts average their gradients
through FSDP (the experts' own units, :func:`lockstep.parallel.fsdp.expert_mesh`); the division by
``ep`` stays the same. Expert parameters are then DTensors on that mesh: the norm, gather and
checkpoint helpers below reduce over it before summing or gathering over ep.

State dicts keep the single-process key names (``...feed_forward.experts.w1``) with the local
slice as value; :func:`gather_full_experts` / :func:`expert_state_dict_full` gather the full
``[E, ...]`` experts (collective) and :func:`load_expert_state_dict_full` loads a full state dict
into an expert-parallel model. Gradient clipping must sum the expert norms over ep
(:func:`clip_grad_norm_expert_parallel`), or ranks would clip by different scales.

Initialisation: ``ExpertParallelExperts.reset_parameters`` draws the *full* stacked weights and
keeps its slice, so ``init_weights(seed)`` after ``apply_expert_parallel`` (e.g. meta build ->
EP -> ``to_empty`` -> ``init_weights``) gives every rank exactly the single-process model (and the
same RNG state afterwards); it costs one full ``[E, F, D]`` tensor transiently per weight.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from lockstep.checkpoint.train_state import clean_fqn
from lockstep.config.base import ConfigError
from lockstep.models.common.moe import GroupedExperts, MoE
from lockstep.parallel.dist_moe import DistMoETotals, make_dist_moe

EXPERT_WEIGHTS = ("w1", "w2", "w3")
#: per-expert biases some families have (``None`` on the module when absent)
EXPERT_BIASES = ("b1", "b2", "b3")


def expert_tensor_names(module: nn.Module) -> list[str]:
    """The per-expert ``[E, ...]`` parameters ``module`` holds: the weights and any present biases."""
    return [n for n in EXPERT_WEIGHTS + EXPERT_BIASES if getattr(module, n, None) is not None]


def _group_of(ep_group):
    """A ProcessGroup from a ProcessGroup, a 1-D DeviceMesh, or None (the default group)."""
    if ep_group is None:
        return dist.group.WORLD
    if hasattr(ep_group, "get_group"):  # DeviceMesh
        return ep_group.get_group()
    return ep_group


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Uneven ``all_to_all_single`` along dim 0; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: send ``in_splits[r]`` rows of ``x`` (in order) to rank
    r, receive ``out_splits[r]`` rows from rank r."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), _group_of(group))


class ExpertParallelExperts(GroupedExperts):
    """This rank's ``E / ep`` experts of a :class:`GroupedExperts`, computing for every ep rank.

    ``w1, w3 [E/ep, F, D]``, ``w2 [E/ep, D, F]`` are the slice of global experts
    ``[expert_offset, expert_offset + n_experts)``; ``n_global_experts`` is E. ``forward(x, counts)``
    takes this rank's tokens sorted by *global* expert and ``counts [E]``, like GroupedExperts, and
    is a collective over ``group`` (every ep rank must call it, in the same layer order).
    """

    takes_routing = False  # rows cross ranks / the hidden dim is split: dispatch and combine stay outside

    def __init__(self, experts: GroupedExperts, group=None) -> None:
        nn.Module.__init__(self)
        self.group = _group_of(group)
        self.ep_size = dist.get_world_size(self.group)
        self.ep_rank = dist.get_rank(self.group)
        self.n_global_experts = experts.n_experts
        if self.n_global_experts % self.ep_size:
            raise ConfigError(f"parallel.ep: {self.ep_size} does not divide n_routed_experts="
                              f"{self.n_global_experts}")
        n_local = self.n_global_experts // self.ep_size
        self.n_experts, self.dim, self.hidden_dim, self.impl = n_local, experts.dim, experts.hidden_dim, experts.impl
        self.init_std, self.out_init_std = experts.init_std, experts.out_init_std
        self.expert_offset = self.ep_rank * n_local
        # whatever else the family's experts carry (an activation, biases: sliced like the weights)
        self.activation = getattr(experts, "activation", None)
        for name in EXPERT_BIASES:
            setattr(self, name, None)
        for name in expert_tensor_names(experts):
            full = getattr(experts, name)
            local = full.detach()[self.expert_offset:self.expert_offset + n_local].clone()
            setattr(self, name, nn.Parameter(local, requires_grad=full.requires_grad))

    def extra_repr(self) -> str:
        return (f"experts {self.expert_offset}..{self.expert_offset + self.n_experts - 1} of "
                f"{self.n_global_experts}, ep_rank={self.ep_rank}/{self.ep_size}")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw the full ``[E, ...]`` weights as GroupedExperts would and keep this rank's slice."""
        _reset_slice(self, self.n_global_experts, self.expert_offset)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _local_weights(self)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return super().forward(x, counts)
        ep, n_local = self.ep_size, self.n_experts
        send_counts = counts.to(torch.int64).reshape(ep, n_local)  # [dest rank, its local expert]
        recv_counts = torch.empty_like(send_counts)  # [source rank, my local expert]
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        received = all_to_all(x, out_splits, in_splits, self.group)  # blocks by source, each by expert
        # regroup by local expert (stable: within an expert, rows stay ordered by source rank)
        local_ids = torch.arange(n_local, device=x.device).repeat(ep)
        row_expert = torch.repeat_interleave(local_ids, recv_counts.flatten().to(x.device),
                                             output_size=received.shape[0])
        order = row_expert.argsort(stable=True)
        local_counts = recv_counts.sum(0)
        grouped = received[order]
        if grouped.shape[0]:
            out = super().forward(grouped, local_counts)
        else:  # nothing routed here: stay in the graph so the reverse exchanges still run on backward
            out = grouped * 0 + sum(w.sum() for w in self.local_weights()) * 0
        restored = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=x.device))
        out = out[restored]
        return all_to_all(out, in_splits, out_splits, self.group)


def _local_weights(module: GroupedExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weights as this rank computes with them: local shards of tensor-parallel (DTensor) ones."""
    from torch.distributed.tensor import DTensor

    return tuple(w.to_local() if isinstance(w, DTensor) else w  # type: ignore[return-value]
                 for w in (module.w1, module.w2, module.w3))


@torch.no_grad()
def _reset_slice(module: GroupedExperts, n_global: int, offset: int) -> None:
    """Draw the full ``[E, ...]`` weights as GroupedExperts would and keep this rank's slice: experts
    ``[offset, offset + n_experts)``, and under expert TP this rank's chunk of the hidden dim."""
    from torch.distributed.tensor import DTensor

    lo, hi = offset, offset + module.n_experts
    for name, std in (("w1", module.init_std), ("w3", module.init_std), ("w2", module.out_init_std)):
        w = getattr(module, name)
        full = torch.empty((n_global, *w.shape[1:]), dtype=w.dtype, device=w.device)
        part = nn.init.normal_(full, mean=0.0, std=std)[lo:hi]
        if isinstance(w, DTensor):
            dim = w.placements[0].dim
            mesh = w.device_mesh
            part = part.chunk(mesh.size(), dim=dim)[mesh.get_local_rank()]
            w = w.to_local()
        w.copy_(part)
    for name in EXPERT_BIASES:
        if getattr(module, name, None) is not None:
            nn.init.zeros_(getattr(module, name))


class TensorParallelExperts(GroupedExperts):
    """A :class:`GroupedExperts` whose weights are DTensors split over the tp mesh on the hidden dim
    (``w1`` / ``w3`` ``Shard(1)``, ``w2`` ``Shard(2)``): it computes every expert's partial output
    from its local shards (the caller sums the partials over tp)."""

    takes_routing = False  # rows cross ranks / the hidden dim is split: dispatch and combine stay outside

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _local_weights(self)

    def reset_parameters(self) -> None:
        _reset_slice(self, self.n_experts, 0)


#: the hidden dim of each expert weight (``w1, w3 [E, F, D]``, ``w2 [E, D, F]``)
HIDDEN_DIM = {"w1": 1, "w3": 1, "w2": 2}


def apply_expert_tensor_parallel(moe: MoE, tp_mesh) -> None:
    """Split the hidden dim of every routed expert of ``moe`` over ``tp_mesh`` (a 1-D DeviceMesh), in
    place: the experts (a GroupedExperts, or an ExpertParallelExperts already split over ep) keep
    their slice as DTensor parameters, chunk ``r`` of the hidden dim on tp rank ``r``. Every tp rank
    must hold the same weights before (they are sliced locally, no communication)."""
    from torch.distributed.tensor import DTensor, Shard

    experts = moe.experts
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    if experts.hidden_dim % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide the expert hidden size "
                          f"model.feed_forward.moe_ffn_dim={experts.hidden_dim}")
    if not isinstance(experts, ExpertParallelExperts):
        experts.__class__ = TensorParallelExperts  # the same module and state, computing from local shards
    for name, dim in HIDDEN_DIM.items():
        w = getattr(experts, name)
        local = w.detach().chunk(tp, dim=dim)[rank].clone()
        setattr(experts, name, nn.Parameter(DTensor.from_local(local, tp_mesh, [Shard(dim)], run_check=False),
                                             requires_grad=w.requires_grad))


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def apply_expert_parallel(model: nn.Module, ep_group=None, ep_chunks: int = 0,
                          capacity_factor: float = 0.0) -> nn.Module:
    """Shard the routed experts of every MoE layer over ``ep_group`` (ProcessGroup, 1-D DeviceMesh, or
    None for the default group), in place; returns ``model``. Raises ConfigError naming
    ``parallel.ep`` when ep does not divide a layer's n_routed_experts or the model has no MoE layer.

    ``ep_chunks`` (``parallel.ep_chunks``): 0 keeps the synchronous uneven exchange of
    :class:`ExpertParallelExperts`; N >= 1 makes every MoE layer a
    :class:`~lockstep.parallel.dist_moe.DistMoE` (exact-split dispatch / grouped experts / combine in N
    overlapped chunks, ``capacity_factor`` = ``parallel.ep_capacity_factor``, 0 = no-drop) and adds
    ``model.moe``, a parameter-free module whose ``pop_auxiliary`` reports the layers' totals.

    Apply before FSDP / activation checkpointing wrap the blocks, and either to a materialised
    model (every rank holding the same full weights, e.g. the same seed) or to a meta model that is
    then ``to_empty``-ed and ``init_weights``-ed (see the module docstring).
    """
    group = _group_of(ep_group)
    ep = dist.get_world_size(group)
    layers = moe_layers(model)
    if not layers:
        raise ConfigError(f"parallel.ep: {ep} needs MoE layers, but the model has none")
    for name, moe in layers:
        if isinstance(moe.experts, ExpertParallelExperts):
            raise RuntimeError(f"{name}.experts is already expert-parallel")
        n = moe.experts.n_experts
        if n % ep:
            raise ConfigError(f"parallel.ep: {ep} does not divide n_routed_experts={n} ({name})")
    for _, moe in layers:
        moe.experts = ExpertParallelExperts(moe.experts, group)
    if ep_chunks:
        if hasattr(model, "moe"):
            raise RuntimeError("apply_expert_parallel: the model already has a 'moe' attribute")
        model.moe = totals = DistMoETotals()
        for i, (_, moe) in enumerate(layers):
            make_dist_moe(moe, i, ep_chunks, capacity_factor, totals)
    return model


def expert_modules(model: nn.Module) -> list[tuple[str, ExpertParallelExperts]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelExperts)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel (rank-local) parameters; every other parameter is replicated over ep."""
    return [p for _, m in expert_modules(model) for p in m.parameters()]


@torch.no_grad()
def sync_expert_parallel_grads(model: nn.Module, ep_group=None) -> None:
    """Plain data parallelism over the ep group (no FSDP): average the replicated gradients over the
    ranks (one coalesced all-reduce) and divide the expert gradients by ep, so every gradient is that
    of the mean of the ranks' losses. A missing gradient counts as zero."""
    group = _group_of(ep_group)
    ep = dist.get_world_size(group)
    experts = {id(p) for p in expert_parameters(model)}
    replicated = []
    seen = set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if id(p) in experts:
            if p.grad is not None:
                p.grad.div_(ep)
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        replicated.append(p)
    if not replicated or ep == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in replicated])
    dist.all_reduce(flat, group=group)
    flat.div_(ep)
    offset = 0
    for p in replicated:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def gather_full_experts(model: nn.Module, ep_group=None) -> dict[str, torch.Tensor]:
    """Every expert weight all-gathered over ep into the full ``[E, ...]`` tensor of the single-process
    model, keyed by its state-dict name (``layers.0.feed_forward.experts.w1``). Collective: every ep
    rank must call it. FSDP-sharded (DTensor) experts are first gathered over their own mesh."""
    group = _group_of(ep_group)
    ep = dist.get_world_size(group)
    out = {}
    for name, module in expert_modules(model):
        for w in expert_tensor_names(module):
            local = _full_tensor(getattr(module, w)).detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(ep)]
            dist.all_gather(parts, local, group=group)
            # wrappers (activation checkpointing, compile) are not part of the single-process name
            out[clean_fqn(f"{name}.{w}" if name else w)] = torch.cat(parts)
    return out


@torch.no_grad()
def expert_state_dict_full(model: nn.Module, ep_group=None, state_dict: dict | None = None) -> dict:
    """``state_dict`` (default ``model.state_dict()``) with the expert entries replaced by the full
    experts of :func:`gather_full_experts` (same keys as one process). Collective over ep. Under
    FSDP pass the full replicated state dict (``get_model_state_dict(..., full_state_dict=True)``)."""
    sd = dict(model.state_dict() if state_dict is None else state_dict)
    sd.update(gather_full_experts(model, ep_group))
    return sd


@torch.no_grad()
def clip_grad_norm_expert_parallel(model: nn.Module, max_norm: float, ep_group=None) -> torch.Tensor:
    """:func:`lockstep.parallel.grad.clip_grad_norm` over the whole expert-parallel model: the
    replicated gradients count once, the expert gradients of every ep rank are summed in (one
    all-reduce), so every rank gets the single-process norm and the same clip scale."""
    from lockstep.parallel.grad import clip_grad_norm

    experts = expert_parameters(model)
    ids = {id(p) for p in experts}
    replicated = [p for p in model.parameters() if id(p) not in ids]
    rep = clip_grad_norm(replicated, math.inf).to(torch.float32)
    exp = clip_grad_norm(experts, math.inf).to(torch.float32)
    exp_sq = (exp * exp).reshape(1).clone()
    dist.all_reduce(exp_sq, group=_group_of(ep_group))
    total = (rep * rep + exp_sq[0]).sqrt()
    if math.isfinite(max_norm):
        scale = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return total


@torch.no_grad()
def load_expert_state_dict_full(model: nn.Module, state_dict: dict, strict: bool = True):
    """Load a single-process (full-expert) state dict into an expert-parallel model: each rank takes
    its slice of every expert weight. No communication."""
    sd = dict(state_dict)
    for name, module in expert_modules(model):
        lo, hi = module.expert_offset, module.expert_offset + module.n_experts
        for w in expert_tensor_names(module):
            key = f"{name}.{w}" if name else w
            if key in sd:
                full = sd[key]
                if full.shape[0] != module.n_global_experts:
                    raise ValueError(f"{key}: expected {module.n_global_experts} experts, got {full.shape[0]}")
                sd[key] = full[lo:hi]
    return model.load_state_dict(sd, strict=strict)
