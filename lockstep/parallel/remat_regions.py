"""``training.activation_checkpoint.mode = "regions"``: named save regions with ``torch_remat``.

Each block of ``model.layers`` becomes one ``torch_remat.checkpoint`` recompute region (named by its
module path, ``layers.3``), and every submodule whose path matches a ``save`` glob runs as a
``torch_remat.region(..., recompute=False)``: autograd keeps what that submodule saves for backward
plus its outputs, and the backward replay skips it. Everything else in the block is recomputed.

Applied from outside the model: the forwards of the blocks and of the matched submodules are
replaced on their instances (parameter names and the module tree do not change); model code never
calls ``torch_remat``.

``save`` entries are module-path globs (``layers.*.attention.wo``; the overrides' matching rule,
:func:`lockstep.config.overrides.match_module_globs`) or op kinds, which torch_remat can express
only as callables it wraps:

- ``op:linear``: every ``nn.Linear`` of a block (its matmul);
- ``op:attention``: the attention kernel call of every attention layer (``AttentionLayer.full_attention``:
  scores, softmax and the value product; not the projections).

ATen-operator kinds (``op:mm``, ``op:bmm``) cannot be expressed: torch_remat annotates callables,
it has no dispatch mode that sees individual operators; ``mode = "selective"`` is the per-operator
policy. A glob that matches a whole block (``layers.0``) leaves that block unchecked (all kept).

RNG: a :class:`RngStateHook` restores the CPU (and current CUDA device's) generator state at the
replay's entry and after each skipped save region, so random ops (dropout) recompute the values
their forward drew; torch_remat puts back the state the replay started from when it ends, so later
draws match a run without checkpointing.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lockstep.config.base import ConfigError
from lockstep.config.overrides import match_module_globs

#: op kind -> what it saves (the names ``save`` accepts with the ``op:`` prefix)
OP_KINDS = {
    "op:linear": "every nn.Linear of a block (its matmul)",
    "op:attention": "each attention layer's kernel call (AttentionLayer.full_attention)",
}

_FIELD = "training.activation_checkpoint.save"
_WRAPPED = "_remat_region"  # instance attribute marking a forward this module replaced


def _remat():
    try:
        import torch_remat
    except ImportError as err:  # a declared dependency; only a broken install lands here
        raise ConfigError("training.activation_checkpoint.mode: 'regions' needs the torch-remat package "
                          "(pip install torch-remat==0.2.2)") from err
    return torch_remat


def check_op_kinds(save: list[str], field: str = _FIELD) -> None:
    """Raise a ConfigError naming ``field`` for an ``op:`` entry that is no known kind."""
    for entry in save:
        if entry.startswith("op:") and entry not in OP_KINDS:
            raise ConfigError(
                f"{field}: unknown op kind {entry!r}; known kinds: {sorted(OP_KINDS)} (torch_remat saves the "
                "outputs of callables it wraps, not of individual ATen operators; per-operator policies are "
                "mode 'selective')")


class RngStateHook:
    """A ``torch_remat.RecomputeStateHook`` over torch's CPU generator and, once CUDA is initialised,
    the current device's. torch_remat snapshots it at a region's entry and after each save region,
    restores those points in the replay, and puts back the state the replay started from when it ends."""

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda

    def restore(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])


_RNG = (RngStateHook(),)


def _block_paths(model: nn.Module) -> dict[str, tuple[str, nn.Module, str]]:
    """Module path -> (block path, module, path inside the block) for every block and its submodules."""
    out: dict[str, tuple[str, nn.Module, str]] = {}
    for key, block in model.layers.named_children():
        prefix = f"layers.{key}"
        for sub, module in block.named_modules():
            out[f"{prefix}.{sub}" if sub else prefix] = (prefix, module, sub)
    return out


def _op_targets(kind: str, module: nn.Module) -> str | None:
    """The method of ``module`` that op kind ``kind`` saves, or None if the module has none."""
    from lockstep.ops.attention import AttentionLayer

    if kind == "op:linear" and isinstance(module, nn.Linear):
        return "forward"
    if kind == "op:attention" and isinstance(module, AttentionLayer):
        return "full_attention"
    return None


def save_targets(model: nn.Module, save: list[str], *, strict: bool = True,
                 field: str = _FIELD) -> dict[str, list[tuple[nn.Module, str, str]]]:
    """Block path -> [(module, method name, region name)] that ``save`` selects in ``model.layers``.

    ``strict``: a glob or op kind that selects nothing is a ConfigError naming ``field`` (off for one
    pipeline stage, which holds only some blocks: the whole model is checked before the split)."""
    check_op_kinds(save, field)
    paths = _block_paths(model)
    globs = [s for s in save if not s.startswith("op:")]
    kinds = [s for s in save if s.startswith("op:")]
    if strict:
        matched = match_module_globs(paths, globs, field)
    else:
        matched = {g: [p for p in paths if fnmatch.fnmatchcase(p, g)] for g in globs}
    targets: dict[str, list[tuple[nn.Module, str, str]]] = {}
    seen: set[tuple[int, str]] = set()

    def add(path: str, method: str) -> None:
        block, module, sub = paths[path]
        if (id(module), method) in seen:
            return
        seen.add((id(module), method))
        name = (sub or "block") + ("" if method == "forward" else f".{method}")
        targets.setdefault(block, []).append((module, method, name))

    for glob in globs:
        for path in matched[glob]:
            add(path, "forward")
    for kind in kinds:
        hits = [(p, m) for p, (_, module, _) in paths.items() if (m := _op_targets(kind, module))]
        if strict and not hits:
            raise ConfigError(f"{field}: {kind!r} matches nothing in this model's blocks ({OP_KINDS[kind]})")
        for path, method in hits:
            add(path, method)
    return targets


def _save_region(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` as a torch_remat save region whose tensor outputs stay available to the bare ops after
    it (the block's own code, which torch_remat cannot see, consumes them during the replay)."""
    remat = _remat()
    region = remat.region(fn, name, recompute=False)

    def saved(*args: Any, **kwargs: Any) -> Any:
        out = region(*args, **kwargs)
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        if tensors:
            remat.recompute_needs_tensor(*tensors)
        return out

    return saved


def _checkpointed_block(forward: Callable[..., Any], name: str) -> Callable[..., Any]:
    """The block's bound ``forward`` as one torch_remat recompute region named ``name``."""
    remat = _remat()
    checkpointed = remat.checkpoint(region_name=name, recompute_state_hooks=_RNG)(forward)

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation / generation: nothing is saved, nothing to replay
            return forward(*args, **kwargs)
        return checkpointed(*args, **kwargs)

    return run


def apply_save_regions(model: nn.Module, save: list[str], *, strict: bool = True) -> nn.Module:
    """Make every block of ``model.layers`` a recompute region with ``save``'s submodules kept
    (in place; returns the model). A block matched by a glob itself is left as it is (all kept)."""
    targets = save_targets(model, save, strict=strict)
    for key, block in model.layers.named_children():
        path = f"layers.{key}"
        if getattr(block, _WRAPPED, False):
            raise ConfigError(f"training.activation_checkpoint: {path} already has save regions applied")
        chosen = targets.get(path, [])
        if any(module is block for module, method, _ in chosen if method == "forward"):
            continue  # the whole block is saved: no checkpoint at all
        for module, method, name in chosen:
            setattr(module, method, _save_region(getattr(module, method), name))
        block.forward = _checkpointed_block(block.forward, path)
        setattr(block, _WRAPPED, True)
    return model


def is_region_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_save_regions` made ``module`` (a block) a recompute region."""
    return bool(getattr(module, _WRAPPED, False))
