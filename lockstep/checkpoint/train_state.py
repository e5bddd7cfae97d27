"""The full training state as checkpoint slots and JSON: model, optimizer, RNG, data loader.

Tensors are named ``model/<fqn>`` and ``optimizer/<fqn>/<state>`` with the FQNs of the unsplit
``Transformer`` (wrappers such as activation checkpointing are stripped; pipeline stages keep the
global layer names; a tied head is stored once, under the embedding), so any parallel layout
names them identically and loads any other's. Slots alias the live tensors: loading writes in
place into parameters, buffers and optimizer state.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch
from torch import nn

from lockstep.checkpoint.layout import Slot

_WRAPPERS = ("._checkpoint_wrapped_module", "._orig_mod", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_fqn(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _parts(model: nn.Module) -> list[nn.Module]:
    """Pipeline ranks hold a ModuleList of stages whose own FQNs are the global ones."""
    if isinstance(model, nn.ModuleList):
        return list(model)
    return [model]


def _expert_rows(module: nn.Module) -> dict[str, tuple[int, int]]:
    """fqn -> (global experts, first local expert) of expert-parallel weights (plain local slices)."""
    out = {}
    for part in _parts(module):
        for prefix, m in part.named_modules():
            if hasattr(m, "n_global_experts") and hasattr(m, "expert_offset"):
                for pname, _ in m.named_parameters(recurse=False):
                    out[clean_fqn(f"{prefix}.{pname}")] = (m.n_global_experts, m.expert_offset)
    return out


def _flex_layouts(module: nn.Module) -> dict[str, object]:
    """fqn -> FlexParam of FlexShard parameters (plain local pieces of a whole parameter)."""
    return {clean_fqn(name): p._flex for part in _parts(module)
            for name, p in part.named_parameters() if hasattr(p, "_flex")}


def _slot(tensor: torch.Tensor, fqn: str, experts: dict[str, tuple[int, int]],
          flex: dict[str, object] | None = None) -> Slot:
    if flex and fqn in flex:
        lay = flex[fqn]
        if tuple(tensor.shape) == tuple(lay.local_shape):  # the parameter or state shaped like it
            offsets = [0] * len(lay.global_shape)
            offsets[lay.dim] = lay.offset
            return Slot(tensor, tuple(lay.global_shape), tuple(offsets))
    if fqn in experts:
        rows, offset = experts[fqn]
        return Slot.row_slice(tensor, rows, offset)
    return Slot.of(tensor)


def param_fqns(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its (first) clean FQN; tied parameters appear once."""
    out: dict[int, str] = {}
    for part in _parts(model):
        for name, p in part.named_parameters(remove_duplicate=False):
            out.setdefault(id(p), clean_fqn(name))
    return out


def model_slots(model: nn.Module) -> dict[str, Slot]:
    experts, flex = _expert_rows(model), _flex_layouts(model)
    slots: dict[str, Slot] = {}
    seen: set[int] = set()
    for part in _parts(model):
        for name, t in part.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue  # tied weights: once
            seen.add(id(t))
            fqn = clean_fqn(name)
            # detach(), not .data: a load writing through it moves the parameter's version counter, which
            # is how copies made from the weights (the engine's packed weights) learn they are stale
            slots[f"model/{fqn}"] = _slot(t.detach(), fqn, experts, flex)
    return slots


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state (as its first step would) so a checkpoint can be loaded into it; an
    optimizer of lockstep's own (Muon) creates its state with ``init_state()``."""
    if hasattr(optimizer, "init_state"):
        optimizer.init_state()
        return
    if not isinstance(optimizer, torch.optim.AdamW):
        raise TypeError(f"checkpointing supports AdamW optimizer state, got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                fused = group.get("fused") or group.get("capturable")
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def optimizer_slots(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Slot]:
    fqns = param_fqns(model)
    experts, flex = _expert_rows(model), _flex_layouts(model)
    slots: dict[str, Slot] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = fqns[id(p)]
            for key, value in optimizer.state[p].items():
                if isinstance(value, torch.Tensor):
                    slots[f"optimizer/{fqn}/{key}"] = _slot(value, fqn, experts, flex) if value.ndim else Slot.of(value)
    return slots


def optimizer_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Hyperparameters per group, with member FQNs (recorded; the recipe rebuilds the groups)."""
    fqns = param_fqns(model)
    return [{**{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, bool, tuple, list))},
             "params": [fqns[id(p)] for p in g["params"]]} for g in optimizer.param_groups]


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict:
    """torch, numpy and Python RNG states as JSON; with ``"cuda"`` (the current device's generator)
    when this process has used CUDA (a CPU run on a GPU machine neither initialises nor records it)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    out = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_initialized():
        out["cuda"] = _b64(torch.cuda.get_rng_state())
    return out


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`; a saved CUDA state is restored when CUDA is in use here."""
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
