"""``local_compile``: named regions of model and ops code, compiled alone when the config enables them.

A region is a pure tensor function declared where it lives::

    @local_compile("rmsnorm")
    def rms_norm(x, weight, eps): ...

Declaring registers ``name -> function`` at import (several functions may share a name: "rmsnorm"
covers plain and zero-centred RMSNorm). ``compile.regions = ["rmsnorm", "swiglu"]`` (``--compile.regions
rmsnorm swiglu``) switches regions on for the process at build time (:func:`enable_regions`, called
by :func:`lockstep.compile.blocks.apply_compile`, which the Trainer calls after parallelizing, as
``numerics.build`` sets its switch). An enabled region, called with autograd on, runs
``torch.compile(fn, fullgraph=True, backend=compile.backend, dynamic=False)``, compiled lazily on its
first call (and once more per new input shape, dtype or autocast state: ``dynamic=False``). A
disabled region is the plain function behind one attribute check; so is an enabled one under
``torch.no_grad`` (evaluation, sampling, generation: their lengths change call to call and would each
compile).

The regions: ``rmsnorm`` (``norm.rms_norm``, ``norm.zero_centered_rms_norm``), ``swiglu``
(``mlp.swiglu_activation``: ``silu(gate) * up``; the projections stay module calls so TP/FSDP hooks
run as in eager), ``rope`` (``rope.apply_rotary``; batch-invariant), ``loss`` (``run.objective.lm_loss``),
``moe_router`` (``moe_routing.route``), ``gated_deltanet_gate`` (``gated_deltanet.gated_deltanet_gate``).

Regions and numerics:

- ``backend="aot_eager"`` runs the same ATen kernels as eager: bitwise equal, forward and grads
  (tests/compile/test_local.py checks each region);
- ``backend="inductor"`` generates fused kernels: fused reductions sum in a different order and
  elementwise chains may be contracted, so results match eager only within a tolerance (tests/compile
  states its bounds and why);
- a region declared ``batch_invariant=False`` (anything Inductor would re-tile: matmuls,
  reductions, transcendentals whose vector and scalar-tail code differ) cannot be enabled with
  ``numerics.batch_invariant``: a ConfigError naming both fields (:func:`check_batch_invariant`).

While a graph capture traces (``lockstep.graph.state.is_capturing()``, which also covers an
enclosing ``torch.compile`` such as whole-block compilation, :mod:`lockstep.compile.blocks`) a region
runs its plain function: the enclosing tracer inlines it and compiles it its own way.

Bitwise with aot_eager holds for each region as a function (tests/compile/test_local.py, fp32; bf16
inputs and bf16 autocast measured too) and for fp32 training (the debug recipe's losses with rmsnorm,
swiglu, rope and loss compiled, or with ``compile.modules=["layers.*"]``: tests/compile/test_blocks.py).
Inside a model a compiled piece can still move a gradient by an ulp at its input: when the input is
also used outside the piece (a block's residual stream enters the norm and the residual add), eager
autograd adds the piece's internal contributions (rms_norm uses ``x`` twice) and the outside one in
engine order, while the compiled backward sums its own first and hands autograd one contribution.
Measured: the rmsnorm region under bf16 autocast changed the embedding's gradient by 1e-7 relative
(the debug recipe's step-2 loss by 4e-6; with a full backward hook on each norm, which also sums
inside first, eager and compiled agree bitwise again), and the rmsnorm region together with
``compile.modules=["layers.*.attention"]`` moved qwen3's q_norm/k_norm weight grads by 1.5e-7 relative.

Unknown names in ``compile.regions`` are ConfigErrors listing the known regions
(:func:`check_region_names`); :func:`known_regions` imports the modules that declare them first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from lockstep.config.base import ConfigError
from lockstep.graph.state import is_capturing

F = TypeVar("F", bound=Callable)

#: modules that declare regions: imported before names are checked (model code imports this module,
#: so the registry cannot import them at its top)
DECLARING_MODULES = (
    "lockstep.models.common.norm",
    "lockstep.models.common.mlp",
    "lockstep.models.common.rope",
    "lockstep.models.common.moe_routing",
    "lockstep.models.common.gated_deltanet",
    "lockstep.run.objective",
)

BACKENDS = ("inductor", "aot_eager")


@dataclasses.dataclass
class _Function:
    """One declared function of a region and its compiled form (built on first enabled call)."""

    fn: Callable
    compiled: Callable | None = None


@dataclasses.dataclass
class Region:
    """A named region: its functions, whether it is batch-invariant-safe, and the process switch."""

    name: str
    batch_invariant: bool
    functions: list[_Function] = dataclasses.field(default_factory=list)
    enabled: bool = False


_REGIONS: dict[str, Region] = {}
_backend = "inductor"


def local_compile(name: str, *, batch_invariant: bool = False) -> Callable[[F], F]:
    """Declare ``fn`` as (part of) region ``name``. ``batch_invariant=True`` only for regions whose
    compiled code cannot depend on the batch shape: elementwise arithmetic without transcendentals
    or reductions (nothing Inductor would re-tile)."""

    def decorate(fn: F) -> F:
        region = _REGIONS.get(name)
        if region is None:
            region = _REGIONS[name] = Region(name, batch_invariant)
        elif region.batch_invariant != batch_invariant:
            raise ValueError(f"local_compile({name!r}): declared both batch-invariant and not")
        entry = _Function(fn)
        # a module re-imported (importlib.reload) replaces its own function instead of adding one
        region.functions = [f for f in region.functions if _qualname(f.fn) != _qualname(fn)] + [entry]

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if region.enabled and torch.is_grad_enabled() and not is_capturing():
                if entry.compiled is None:
                    entry.compiled = torch.compile(fn, fullgraph=True, backend=_backend, dynamic=False)
                return entry.compiled(*args, **kwargs)
            return fn(*args, **kwargs)

        run.region = name  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return decorate


def _qualname(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def known_regions() -> dict[str, Region]:
    """Every declared region by name (the declaring modules imported first)."""
    for module in DECLARING_MODULES:
        importlib.import_module(module)
    return dict(_REGIONS)


def check_region_names(names: list[str], field: str) -> None:
    """Raise a ConfigError naming ``field`` for a name that is no declared region."""
    regions = known_regions()
    for name in names:
        if name not in regions:
            raise ConfigError(f"{field}: unknown compile region {name!r}; known regions: {sorted(regions)}")


def check_batch_invariant(names: list[str], batch_invariant: bool, field: str = "compile.regions") -> None:
    """Refuse a region that is not batch-invariant-safe while ``numerics.batch_invariant`` is on."""
    if not batch_invariant:
        return
    regions = known_regions()
    unsafe = [n for n in names if n in regions and not regions[n].batch_invariant]
    if unsafe:
        safe = sorted(n for n, r in regions.items() if r.batch_invariant)
        raise ConfigError(
            f"{field}: region(s) {unsafe} are not batch-invariant (Inductor re-tiles their matmuls, "
            f"reductions or transcendentals by shape) and cannot be compiled with "
            f"numerics.batch_invariant=true; batch-invariant regions: {safe}; or set numerics.batch_invariant=false")


def enable_regions(names: list[str], backend: str = "inductor") -> None:
    """Make exactly ``names`` the compiled regions of this process, compiled with ``backend``
    (a changed backend drops the compiled forms; they rebuild on next call)."""
    global _backend
    check_region_names(names, "compile.regions")
    if backend not in BACKENDS:
        raise ConfigError(f"compile.backend: must be one of {list(BACKENDS)}, got {backend!r}")
    if backend != _backend:
        for region in _REGIONS.values():
            for entry in region.functions:
                entry.compiled = None
        _backend = backend
    for name, region in _REGIONS.items():
        region.enabled = name in names


def enabled_regions() -> list[str]:
    """Names of the regions compiled in this process now."""
    return sorted(n for n, r in _REGIONS.items() if r.enabled)


@contextlib.contextmanager
def regions_enabled(names: list[str], backend: str = "inductor") -> Iterator[None]:
    """``enable_regions(names, backend)`` inside the block; the previous setting is restored after it."""
    previous, previous_backend = enabled_regions(), _backend
    enable_regions(names, backend)
    try:
        yield
    finally:
        enable_regions(previous, previous_backend)
