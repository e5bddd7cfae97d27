"""Whole-block compilation: ``compile.modules = ["layers.*"]`` compiles the forward of every module
whose path matches, with one compiled code object shared by all of them.

Every matched module's ``forward`` becomes a call of one ``torch.compile`` of its class's forward
function (one per distinct function, shared across instances). Dynamo caches compiled code on the
function's code object and, with ``inline_inbuilt_nn_modules`` (on by default since torch 2.5), treats
the module's parameters as graph inputs instead of guarding on the instance: the first layer
compiles, every other layer reuses that code (tests/compile/test_blocks.py counts one compiled frame
for all layers). Globs follow :func:`lockstep.config.overrides.match_module_globs` (``fnmatch`` over
module paths; a glob that matches nothing is a ConfigError naming ``compile.modules``). Paths are
the model's own (``layers.3``, ``layers.3.attention``): wrapper segments that activation
checkpointing and ``torch.compile`` insert are dropped, so a glob means the same with or without
them. A match inside another match is covered by the outer one and left alone: ``layers.*`` (which
also matches ``layers.3.attention``) compiles the blocks.

Composition: only the inner forward is compiled. Hooks stay eager around it: FSDP2's
all-gather/reshard hooks (``fully_shard`` keeps the module and its class's forward) and activation
checkpointing, whose wrapper calls the compiled block in forward and again when it recomputes.
With pipeline parallel, ``model`` is the ModuleList of this rank's stages: each stage's paths are
matched, and a glob is dead only if no stage matches it.

Eager fallbacks, by design: calls without autograd (``torch.no_grad``: evaluation, sampling,
generation, whose lengths change call to call and would each compile under ``dynamic=False``) and
calls while a graph capture traces (``lockstep.graph.state.is_capturing()``: the graph trainer inlines
the plain forward and runs its own passes). Named regions (:mod:`lockstep.compile.local`) inside a
compiled block are inlined into it.

Limits (measured with torch 2.13): MoE blocks do not compile whole. The grouped-mm experts fail to
trace in fp32 (``torch._grouped_mm``'s meta kernel accepts bf16 only, while the CPU kernel runs fp32)
and the expert loop breaks the graph at its data-dependent group sizes (11 compiled frames for 4
qwen3_moe blocks, 9 for 2: not one per block class); for MoE families
compile ``layers.*.attention`` and the ``moe_router`` / ``rmsnorm`` / ``swiglu`` regions instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lockstep.compile.config import CompileConfig
from lockstep.compile.local import enable_regions
from lockstep.config.base import ConfigError
from lockstep.config.overrides import match_module_globs
from lockstep.graph.state import is_capturing

#: path segments that wrappers insert (activation checkpointing, torch.compile's OptimizedModule)
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")


def apply_compile(model: nn.Module, config: CompileConfig, *, batch_invariant: bool = False) -> list[str]:
    """Enable ``config.regions`` for this process and compile the modules ``config.modules`` selects,
    after the model is parallelized. Returns the compiled module paths (``stage.path`` under pp)."""
    config.check_batch_invariant(batch_invariant)
    enable_regions(config.regions, config.backend)
    if not config.modules:
        return []
    parts = list(model) if isinstance(model, nn.ModuleList) else [model]  # pp: this rank's stages
    by_part = [logical_modules(part) for part in parts]
    all_paths = sorted({path for modules in by_part for path in modules})
    matches = match_module_globs(all_paths, config.modules, "compile.modules")  # dead globs: errors
    selected = {path for paths in matches.values() for path in paths}
    compiled: dict[Callable, Callable] = {}
    done = []
    for index, modules in enumerate(by_part):
        for path in sorted(selected & modules.keys()):
            if any(path.startswith(other + ".") for other in selected):
                continue  # inside another match: compiled as part of it
            compile_forward(modules[path], config.backend, compiled, path=path)
            done.append(path if len(parts) == 1 else f"{index}.{path}")
    return done


def logical_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module path (wrapper segments dropped) -> the innermost module at that path."""
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        path = ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)
        if path:
            out[path] = module  # named_modules is pre-order: a wrapper's inner module comes after it
    return out


def compile_forward(module: nn.Module, backend: str, compiled: dict[Callable, Callable] | None = None,
                    path: str = "") -> None:
    """Route ``module``'s forward through one ``torch.compile`` of its class's forward function, shared
    through ``compiled`` (function -> compiled function) with every module of that function.

    A forward already replaced on the instance by someone else (``activation_checkpoint.mode=regions``
    makes each block's forward a torch_remat region that way) is a ConfigError: compiling the class's
    forward would silently drop that wrapper."""
    current = module.__dict__.get("forward")
    if current is not None and not isinstance(current, CompiledForward):
        raise ConfigError(
            f"compile.modules: {path or type(module).__name__}'s forward is already wrapped on the instance "
            f"({getattr(current, '__qualname__', type(current).__name__)}; activation_checkpoint.mode=regions "
            "wraps blocks this way), and compiling the class's forward would drop that wrapper; compile other "
            "modules or use activation_checkpoint.mode none/full/selective")
    compiled = {} if compiled is None else compiled
    function = type(module).forward
    if function not in compiled:
        compiled[function] = torch.compile(function, backend=backend, dynamic=False)
    module.forward = CompiledForward(module, function, compiled[function])


class CompiledForward:
    """A module's forward: the shared compiled function, or the plain one (no grad, graph capture)."""

    def __init__(self, module: nn.Module, plain: Callable, compiled: Callable) -> None:
        self.module, self.plain, self.compiled = module, plain, compiled

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled() or is_capturing():
            return self.plain(self.module, *args, **kwargs)
        return self.compiled(self.module, *args, **kwargs)
