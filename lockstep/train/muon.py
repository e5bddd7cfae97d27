"""Muon: momentum orthogonalised by Newton-Schulz on hidden matrices, AdamW on everything else.

Which parameters get Muon (by shape and module path, FQNs as in checkpoints):

- **Muon**: every parameter with ``ndim >= 2`` that is not listed below: attention and MLP
  projections, the MoE router, and stacked expert weights ``[E, out, in]`` (orthogonalised as E
  separate ``[out, in]`` matrices).
- **AdamW**: ``ndim < 2`` parameters (norm scales, biases), parameters of ``nn.Embedding`` modules,
  the output head (top-level ``output``), and ``optimizer.adamw_params`` globs. A tied head is the
  embedding's tensor, so it is AdamW once, as the embedding.

The update of a Muon matrix ``W [out, in]`` with gradient ``G`` (:func:`muon_update`, one place, so a
distributed version that holds whole matrices reuses it unchanged)::

    B  <- momentum * B + G                              (momentum buffer, fp32, like W)
    M  <- G + momentum * B  (Nesterov)  or  B
    O  <- NewtonSchulz5(M / ||M||_F)                    (approximately U V^T of M = U S V^T)
    W  <- W * (1 - lr * weight_decay) - lr * 0.2 * sqrt(max(out, in)) * O

``0.2 * sqrt(max(out, in))`` is Moonlight's update-RMS matching: ``O`` has singular values near 1, so
its RMS is about ``1 / sqrt(max(out, in))``; the factor makes it ~0.2, AdamW's typical update RMS,
so AdamW's ``lr`` and ``weight_decay`` carry over. Weight decay is decoupled (as AdamW's).

Per-head (``optimizer.muon_per_head``: globs over parameter FQNs, e.g.
``layers.*.attention.wq.weight``): each ``head_dim``-row block (``model.config.resolved_head_dim``)
of those matrices is its own unit: its own Newton-Schulz and the scale of its own shape ``[head_dim,
in]``. Default: whole matrices. A glob that matches nothing, a non-Muon parameter, or a matrix whose
rows are not whole heads is a ConfigError naming the field.

Newton-Schulz runs in ``optimizer.ns_dtype``: float32 by default (on CPU the iteration is a few
small matmuls per matrix, cheap beside the step, and fp32 keeps the result independent of how the
bf16 rounding falls; "bfloat16" halves its cost on accelerators, as the reference implementation
does). It runs one 2-D unit at a time (:func:`orthogonalise_units`), never batched over a stack: a
batched matmul's rounding can depend on the batch size, and a rank holding some of the units must
get the bits one process gets.

Distributed (:func:`muon_update` reads the layout, the update math stays in one place):

- FlexShard parameters (``param._flex``, lockstep.parallel.flex; the optimizer sees local storage),
  by :func:`flex_route`: **owned** -- the owner orthogonalises its whole matrix, the other ranks
  (0-row storage) skip it; **block_shard** -- when the local blocks are whole units (blocks of
  whole heads of a per-head matrix, or whole matrices of a stack ``[E, out, in]`` split along E)
  each rank orthogonalises its own units with no communication; otherwise, and for **shard**, the
  gather-everything baseline: ``_flex.gather_full`` of the momentum-corrected matrix on every rank,
  orthogonalise, keep ``_flex.shard_of``. Momentum, weight decay and the AdamW part are elementwise
  on the local storage (0-element pieces included). Bitwise equal to one process (tests/train/
  test_muon_flex.py) where every piece starts at a multiple of the CPU's vector width (16 fp32
  elements with AVX-512: any matrix with a multiple of 16 columns): the CPU kernels (the fused
  AdamW's, ``add(alpha=)``) run a vector body and a scalar tail that can round differently
  (measured for the fused AdamW, the first 37 elements of a 1000-element tensor stepped alone, 100
  seeds: 9 of the 500 tail elements differ after 5 steps, by up to 64 ulp).
- DTensor (FSDP2, TP) matrices take the gather-everything baseline: ``full_tensor()``,
  orthogonalise, redistribute back to the shard.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.adamw import adamw

from lockstep.config.base import ConfigError
from lockstep.config.overrides import match_module_globs

if TYPE_CHECKING:
    from lockstep.train.optim import OptimizerConfig

#: the quintic Newton-Schulz coefficients (a, b, c) of X <- a X + b (X X^T) X + c (X X^T)^2 X
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: Moonlight's update-RMS factor
RMS_SCALE = 0.2


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonalisation of the last two dims of ``g`` (batched over leading dims): the
    result has ``g``'s singular vectors and singular values in roughly [0.7, 1.2] (the quintic
    trades exact convergence to 1 for a steep slope at 0). Returned in ``dtype``."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix X X^T
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x


def unit_shape(shape: tuple[int, ...], head_dim: int | None = None) -> tuple[int, int]:
    """The shape of one orthogonalisation unit of a whole matrix (or stack) of ``shape``: the last two
    dims, or one head's ``[head_dim, in]`` block of rows (per-head)."""
    return (head_dim, shape[-1]) if head_dim else (shape[-2], shape[-1])


def muon_scale(shape: tuple[int, ...]) -> float:
    """Update multiplier for a unit (or stack of units) of ``shape``: 0.2 * sqrt(max(out, in))."""
    return RMS_SCALE * math.sqrt(max(shape[-2], shape[-1]))


def orthogonalise_units(m: torch.Tensor, steps: int, dtype: torch.dtype, head_dim: int | None = None) -> torch.Tensor:
    """Newton-Schulz of every unit of ``m`` (whole units: whole matrices, or whole heads' row blocks),
    one 2-D unit at a time: a batched matmul may round differently with the batch size (measured on
    CPU with 2 threads: a [16, 64, 1024] stack is not bitwise the same as its heads one by one), and
    a rank holding some of the units must get the bits one process gets for them."""
    if m.numel() == 0:  # a rank's empty piece
        return m.to(dtype)
    rows, cols = unit_shape(m.shape, head_dim)
    units = m.reshape(-1, rows, cols)
    if units.shape[0] == 1:
        return newton_schulz(units[0], steps, dtype).view(m.shape)
    out = torch.empty(units.shape, dtype=dtype, device=m.device)
    for i, unit in enumerate(units):
        out[i] = newton_schulz(unit, steps, dtype)
    return out.view(m.shape)


def flex_route(flex: Any, ndim: int, head_dim: int | None) -> str:
    """How a FlexShard parameter (``param._flex``, lockstep.parallel.flex) is orthogonalised:
    "local" (this rank's storage is whole units: orthogonalise it, no communication), "skip" (an
    "owned" matrix held by another rank: nothing here) or "gather" (the gather-everything baseline).
    The answer depends only on the bucket's layout, never on this rank's piece (a block_shard rank may
    hold the whole matrix while the others hold nothing), so every rank of the group that holds a
    piece takes the same route: the gather is a collective."""
    if flex.world == 1:
        return "local"
    if flex.placement == "owned":
        return "local" if flex.rank == flex.owner else "skip"
    if flex.placement == "block_shard":
        if flex.dim < ndim - 2:  # whole matrices of a stack [E, out, in]
            return "local"
        # per-head, blocks of whole heads: every piece starts at a multiple of the block and ends
        # there or at the last row, and the row count is a multiple of head_dim (checked at build)
        if head_dim and flex.dim == ndim - 2 and flex.block % head_dim == 0:
            return "local"
    return "gather"


@torch.no_grad()
def muon_update(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, *, lr: float, weight_decay: float,
                momentum: float, nesterov: bool, ns_steps: int, ns_dtype: torch.dtype,
                head_dim: int | None = None) -> None:
    """One Muon step of one matrix (or stack ``[E, out, in]``), in place on ``param`` and ``buf``.
    ``param`` may be a whole tensor, a DTensor shard or FlexShard local storage (``param._flex``):
    momentum, weight decay and the step are elementwise on what this rank holds; only which whole
    units this rank orthogonalises differs (:func:`flex_route`)."""
    flex = getattr(param, "_flex", None)
    route = "local" if flex is None else flex_route(flex, param.ndim, head_dim)
    if route == "skip":
        return
    buf.mul_(momentum).add_(grad)
    m = grad.add(buf, alpha=momentum) if nesterov else buf
    if route == "gather":  # every rank gathers the whole matrix, orthogonalises it and keeps its piece
        ortho = flex.shard_of(orthogonalise_units(flex.gather_full(m), ns_steps, ns_dtype, head_dim))
    else:
        ortho = _orthogonalise(m, ns_steps, ns_dtype, head_dim)
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    shape = flex.global_shape if flex is not None else param.shape
    param.add_(ortho.to(param.dtype), alpha=-lr * muon_scale(unit_shape(shape, head_dim)))


def _orthogonalise(m: torch.Tensor, steps: int, dtype: torch.dtype, head_dim: int | None) -> torch.Tensor:
    """Newton-Schulz of whole units. A DTensor (FSDP2/TP shards) takes the gather-everything
    baseline: every rank gathers the whole matrix, orthogonalises it and keeps its own shard (a
    Replicate -> Shard redistribute is a local slice, no communication)."""
    if not hasattr(m, "device_mesh"):
        return orthogonalise_units(m, steps, dtype, head_dim)
    from torch.distributed.tensor import DTensor, Replicate

    whole = orthogonalise_units(m.full_tensor(), steps, dtype, head_dim)
    replicated = DTensor.from_local(whole, m.device_mesh, [Replicate()] * m.device_mesh.ndim, run_check=False)
    return replicated.redistribute(m.device_mesh, m.placements)


class Muon(torch.optim.Optimizer):
    """Muon groups (``use_muon=True``: :func:`muon_update` per parameter, per head when the group has a
    ``head_dim``) and AdamW groups (the fused
    AdamW kernel, as :class:`~lockstep.train.optim.OptimizerConfig` with ``name="adamw"``) in one
    optimizer, so the trainer's per-group ``lr`` and the checkpoint's state slots see one object.
    State: ``momentum_buffer`` (Muon); ``step``, ``exp_avg``, ``exp_avg_sq`` (AdamW)."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 momentum: float, nesterov: bool, ns_steps: int, ns_dtype: torch.dtype) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, use_muon=False, head_dim=None)
        self.ns_dtype = ns_dtype
        super().__init__(groups, defaults)

    def init_state(self) -> None:
        """Create every parameter's state as its first step would (a checkpoint loads into it)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if state:
                    continue
                if group["use_muon"]:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                else:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("Muon.step does not take a closure")
        self.init_state()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["use_muon"]:
                for p in params:
                    muon_update(p, p.grad, self.state[p]["momentum_buffer"], lr=group["lr"],
                                weight_decay=group["weight_decay"], momentum=group["momentum"],
                                nesterov=group["nesterov"], ns_steps=group["ns_steps"], ns_dtype=self.ns_dtype,
                                head_dim=group["head_dim"])
                continue
            beta1, beta2 = group["betas"]
            states = [self.state[p] for p in params]
            adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                  [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], fused=True,
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=group["eps"], maximize=False)


def _owners(model: nn.Module) -> dict[int, tuple[str, bool]]:
    """id(parameter) -> (clean FQN of its first appearance, whether any owner is an ``nn.Embedding``)."""
    from lockstep.checkpoint.train_state import clean_fqn, param_fqns

    fqns = param_fqns(model)
    embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                for p in m.parameters(recurse=False)}
    return {i: (clean_fqn(fqn), i in embedded) for i, fqn in fqns.items()}


def split_parameters(model: nn.Module, adamw_globs: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(Muon FQNs, AdamW FQNs) of ``model``'s trainable parameters, by the rule in the module docstring."""
    owners = _owners(model)
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    fqns = {i: owners[i][0] for i in params}
    extra: set[str] = set()
    if adamw_globs:
        for matched in match_module_globs(fqns.values(), adamw_globs, "optimizer.adamw_params").values():
            extra.update(matched)
    muon, rest = [], []
    for i, p in params.items():
        fqn, embedding = owners[i]
        adam = (p.ndim < 2 or embedding or fqn.split(".")[0] == "output"
                or fqn in extra)
        (rest if adam else muon).append(fqn)
    return muon, rest


def build_muon(cfg: OptimizerConfig, model: nn.Module) -> Muon:
    """The Muon optimizer of ``cfg`` (``name="muon"``) over ``model``'s trainable parameters."""
    from lockstep.train.optim import _mark_parameters_written

    muon_fqns, _ = split_parameters(model, cfg.adamw_params)
    muon_set = set(muon_fqns)
    owners = _owners(model)
    per_head, head_dim = _per_head(model, owners, muon_set, cfg.muon_per_head)
    # AdamW groups by (decays?, is a DTensor?), as name="adamw": one fused call may not mix sharded
    # and plain tensors (expert-parallel weights stay plain beside FSDP's DTensors).
    whole, heads, adam = [], [], {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        fqn = owners[id(p)][0]
        if fqn in per_head:
            heads.append(p)
        elif fqn in muon_set:
            whole.append(p)
        else:
            adam.setdefault((p.ndim >= 2, hasattr(p, "device_mesh")), []).append(p)
    groups = [{"params": whole, "use_muon": True, "weight_decay": cfg.weight_decay}] if whole else []
    if heads:
        groups.append({"params": heads, "use_muon": True, "weight_decay": cfg.weight_decay, "head_dim": head_dim})
    groups += [{"params": ps, "use_muon": False, "weight_decay": cfg.weight_decay if decays else 0.0}
               for (decays, _), ps in sorted(adam.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]
    optimizer = Muon(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, momentum=cfg.momentum,
                     nesterov=cfg.nesterov, ns_steps=cfg.ns_steps, ns_dtype=getattr(torch, cfg.ns_dtype))
    optimizer.register_step_post_hook(_mark_parameters_written)
    return optimizer


def _per_head(model: nn.Module, owners: dict[int, tuple[str, bool]], muon_set: set[str],
              globs: list[str]) -> tuple[set[str], int | None]:
    """(FQNs orthogonalised per head, the model's head_dim) of ``optimizer.muon_per_head``: each glob
    must match a parameter, every match must be a Muon matrix whose rows are whole heads."""
    if not globs:
        return set(), None
    field = "optimizer.muon_per_head"
    config = getattr(model[0] if isinstance(model, nn.ModuleList) else model, "config", None)
    head_dim = getattr(config, "resolved_head_dim", None)
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ConfigError(f"{field}: needs a model with config.resolved_head_dim, got {type(model).__name__}")
    params = {owners[id(p)][0]: p for p in model.parameters() if p.requires_grad}
    matched = {fqn for fqns in match_module_globs(params, globs, field).values() for fqn in fqns}
    for fqn in sorted(matched):
        if fqn not in muon_set:
            raise ConfigError(f"{field}: {fqn!r} is not a Muon matrix (AdamW takes it: embedding, head, "
                              f"1-D or optimizer.adamw_params)")
        flex = getattr(params[fqn], "_flex", None)
        rows = (flex.global_shape if flex is not None else params[fqn].shape)[-2]
        if rows % head_dim:
            raise ConfigError(f"{field}: {fqn!r} has {rows} rows, not a multiple of head_dim {head_dim}")
    return matched, head_dim
