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

Newton-Schulz runs in ``optimizer.ns_dtype``: float32 by default (on CPU the iteration is a few
small matmuls per matrix, cheap beside the step, and fp32 keeps the result independent of how the
bf16 rounding falls; "bfloat16" halves its cost on accelerators, as the reference implementation
does). Sharded (DTensor: FSDP2, TP) matrices take the gather-everything baseline: every rank gathers
the whole momentum-corrected matrix, orthogonalises it and keeps its shard (``_orthogonalise``); the
distributed Muon of issue #20 (whole matrices owned by ranks, no gather) replaces it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.adamw import adamw

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


def muon_scale(shape: torch.Size) -> float:
    """Update multiplier for a matrix (or stack of matrices) of ``shape``: 0.2 * sqrt(max(out, in))."""
    return RMS_SCALE * math.sqrt(max(shape[-2], shape[-1]))


@torch.no_grad()
def muon_update(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, *, lr: float, weight_decay: float,
                momentum: float, nesterov: bool, ns_steps: int, ns_dtype: torch.dtype) -> None:
    """One Muon step of one whole matrix (or stack ``[E, out, in]``), in place on ``param`` and ``buf``."""
    buf.mul_(momentum).add_(grad)
    m = grad.add(buf, alpha=momentum) if nesterov else buf
    ortho = _orthogonalise(m, ns_steps, ns_dtype).to(param.dtype)
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    param.add_(ortho, alpha=-lr * muon_scale(param.shape))


def _orthogonalise(m: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz of a whole matrix. A DTensor (FSDP2/TP shards) takes the gather-everything
    baseline: every rank gathers the whole matrix, orthogonalises it and keeps its own shard (a
    Replicate -> Shard redistribute is a local slice, no communication)."""
    if not hasattr(m, "device_mesh"):
        return newton_schulz(m, steps, dtype)
    from torch.distributed.tensor import DTensor, Replicate

    whole = newton_schulz(m.full_tensor(), steps, dtype)
    replicated = DTensor.from_local(whole, m.device_mesh, [Replicate()] * m.device_mesh.ndim, run_check=False)
    return replicated.redistribute(m.device_mesh, m.placements)


class Muon(torch.optim.Optimizer):
    """Muon groups (``use_muon=True``: :func:`muon_update` per parameter) and AdamW groups (the fused
    AdamW kernel, as :class:`~lockstep.train.optim.OptimizerConfig` with ``name="adamw"``) in one
    optimizer, so the trainer's per-group ``lr`` and the checkpoint's state slots see one object.
    State: ``momentum_buffer`` (Muon); ``step``, ``exp_avg``, ``exp_avg_sq`` (AdamW)."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 momentum: float, nesterov: bool, ns_steps: int, ns_dtype: torch.dtype) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, use_muon=False)
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
                                nesterov=group["nesterov"], ns_steps=group["ns_steps"], ns_dtype=self.ns_dtype)
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
    # AdamW groups by (decays?, is a DTensor?), as name="adamw": one fused call may not mix sharded
    # and plain tensors (expert-parallel weights stay plain beside FSDP's DTensors).
    muon, adam = [], {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if owners[id(p)][0] in muon_set:
            muon.append(p)
        else:
            adam.setdefault((p.ndim >= 2, hasattr(p, "device_mesh")), []).append(p)
    groups = [{"params": muon, "use_muon": True, "weight_decay": cfg.weight_decay}] if muon else []
    groups += [{"params": ps, "use_muon": False, "weight_decay": cfg.weight_decay if decays else 0.0}
               for (decays, _), ps in sorted(adam.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]
    optimizer = Muon(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, momentum=cfg.momentum,
                     nesterov=cfg.nesterov, ns_steps=cfg.ns_steps, ns_dtype=getattr(torch, cfg.ns_dtype))
    optimizer.register_step_post_hook(_mark_parameters_written)
    return optimizer
