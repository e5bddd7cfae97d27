"""Capture one micro-batch's forward + loss + backward as one FX graph (the GraphTrainer's core).

:func:`capture_step` traces, with ``make_fx`` in real mode, a function of
``(params, buffers, module_state, batch)`` that runs the objective on the model (its parameters and
buffers swapped for the graph inputs), divides the loss by ``accumulate`` and takes
``torch.autograd.grad`` of it w.r.t. the trainable parameters. The graph returns the gradients, the
objective's report tensors (pytree-flattened) and the module state the forward left behind.

Nothing is baked in as a constant: parameters, buffers, the batch's tensors and tensors modules keep as
plain attributes (``module_state``: e.g. MoE ``pending_counts`` pooled over micro-batches) are graph
inputs; attributes a forward assigns become graph outputs that :meth:`CapturedStep.run` assigns back
after each replay. Autocast is traced into the graph as explicit casts, so replay runs without it.

Every node carries ``meta["module_path"]`` (the module the op ran in, "" outside any) and
``meta["phase"]`` ("forward"/"backward"): forward ops take the path from a module-hook stack, backward
ops that of the forward op that created their autograd node (``seq_nr``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from lockstep.graph.state import capturing
from lockstep.graph.state_attrs import ModuleState

_META = "lockstep"  # key of our annotation in node.meta["custom"] while tracing


class GraphCaptureError(RuntimeError):
    """The step cannot be captured as one graph (a data-dependent read, a missing torch API)."""


def require_capture_apis() -> None:
    """Raise a clear error when this torch lacks an API the capture relies on (private ones included)."""
    missing = []
    try:
        from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401
    except ImportError:
        missing.append("torch.fx.experimental.proxy_tensor.make_fx")
    try:
        from torch.nn.utils.stateless import _reparametrize_module  # noqa: F401
    except ImportError:
        missing.append("torch.nn.utils.stateless._reparametrize_module (torch.func.functional_call)")
    import torch.fx.traceback as fx_traceback

    for name in ("preserve_node_meta", "get_current_meta"):
        if not hasattr(fx_traceback, name):
            missing.append(f"torch.fx.traceback.{name}")
    if not hasattr(torch.autograd, "_get_sequence_nr"):
        missing.append("torch.autograd._get_sequence_nr")
    if missing:
        raise GraphCaptureError(f"training.mode=graph needs {', '.join(missing)}, missing from torch "
                                f"{torch.__version__}; use training.mode=eager")


# ------------------------------------------------------------------ module paths on nodes

class _PathTracker:
    """A stack of module paths kept by global forward hooks while a capture traces; each push/pop writes
    the current path into fx's ``current_meta["custom"]``, which ``make_fx`` copies onto new nodes."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        self.stack: list[str] = []
        self.phase = "forward"

    def _set_meta(self) -> None:
        import torch.fx.traceback as fx_traceback

        meta = fx_traceback.get_current_meta()
        meta["custom"] = {_META: (self.stack[-1] if self.stack else "", self.phase)}

    def _pre(self, module: nn.Module, args: Any) -> None:
        top = self.stack[-1] if self.stack else ""
        self.stack.append(self.names.get(id(module), top))
        self._set_meta()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()
        self._set_meta()

    def backward(self, roots: list[torch.Tensor]) -> None:
        """Entering the backward: tag each autograd node's ops with its sequence number (the one its
        forward op's node carries), as AOTAutograd does for its joint graphs."""
        import torch.fx.traceback as fx_traceback

        self.phase = "backward"
        self._set_meta()
        seen: set = set()
        queue = [t.grad_fn for t in roots if t.grad_fn is not None]
        while queue:
            node = queue.pop()
            if node in seen:
                continue
            seen.add(node)
            seq = node._sequence_nr()
            node.register_prehook(lambda grad_outputs, seq=seq: fx_traceback.set_grad_fn_seq_nr(seq))
            node.register_hook(lambda grad_inputs, grad_outputs: fx_traceback.reset_grad_fn_seq_nr())
            queue.extend(fn for fn, _ in node.next_functions if fn is not None)

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    @contextlib.contextmanager
    def installed(self) -> Iterator["_PathTracker"]:
        import torch.fx.traceback as fx_traceback
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        with fx_traceback.preserve_node_meta():
            self._set_meta()
            pre = register_module_forward_pre_hook(self._pre)
            post = register_module_forward_hook(self._post)
            try:
                yield self
            finally:
                pre.remove()
                post.remove()


def annotate_nodes(gm: torch.fx.GraphModule) -> None:
    """Move the tracer's annotations to ``meta["module_path"]`` / ``meta["phase"]`` on every node;
    a backward node takes the path of the forward node that created its autograd node (same seq_nr)."""
    forward_path: dict[int, str] = {}
    for node in gm.graph.nodes:
        path, phase = node.meta.get("custom", {}).get(_META, ("", "forward"))
        if phase == "forward" and "seq_nr" in node.meta:
            forward_path.setdefault(node.meta["seq_nr"], path)
    for node in gm.graph.nodes:
        custom = node.meta.get("custom", {})
        path, phase = custom.pop(_META, ("", "backward" if node.op == "output" else "forward"))
        if not custom:
            node.meta.pop("custom", None)
        if phase == "backward":
            path = forward_path.get(node.meta.get("seq_nr"), "")
        node.meta["module_path"], node.meta["phase"] = path, phase


# ------------------------------------------------------------------ the captured step

@dataclasses.dataclass
class CapturedStep:
    """A captured micro-batch step; :meth:`run` replays it on the model's current tensors."""

    gm: torch.fx.GraphModule
    model: nn.Module
    #: parameter names (no duplicates of tied weights), in graph-input order; and which get a gradient
    param_names: list[str]
    trainable: list[bool]
    buffer_names: list[str]
    state: ModuleState
    #: from the trace: which trainable parameters got a gradient (unused ones keep ``.grad`` as it is)
    has_grad: list[bool]
    #: rebuilds the report from its tensor leaves
    report_rebuild: Callable[[list[torch.Tensor]], Any]
    n_report: int
    #: each parameter's DTensor layout (mesh, placements, shape, stride) or None for a plain tensor
    layouts: list[tuple | None]

    def inputs(self, batch_leaves: list) -> tuple:
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        return ([_local(params[n]) for n in self.param_names], [buffers[n] for n in self.buffer_names],
                self.state.read(), batch_leaves)

    @torch.no_grad()
    def run(self, batch_leaves: list) -> tuple[Any, list[torch.Tensor | None]]:
        """Replay: ``(report, grads)``; grads align with the trainable parameters (None: unused), as
        DTensors where the parameter is one. Module state the forward sets is assigned back."""
        flat = self.gm(*self.inputs(batch_leaves))
        n_grads = sum(self.has_grad)
        grads_flat, report_flat, state_flat = (flat[:n_grads], flat[n_grads:n_grads + self.n_report],
                                               flat[n_grads + self.n_report:])
        self.state.write(list(state_flat))
        it = iter(grads_flat)
        grads: list[torch.Tensor | None] = []
        layouts = [lay for lay, t in zip(self.layouts, self.trainable) if t]
        for present, layout in zip(self.has_grad, layouts):
            g = next(it) if present else None
            if g is not None and layout is not None:
                from torch.distributed.tensor import DTensor

                mesh, placements, shape, stride = layout
                g = DTensor.from_local(g, mesh, placements, run_check=False, shape=shape, stride=stride)
            grads.append(g)
        return self.report_rebuild(list(report_flat)), grads

    def trainable_params(self) -> list[nn.Parameter]:
        params = dict(self.model.named_parameters())
        return [params[n] for n, t in zip(self.param_names, self.trainable) if t]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if _is_dtensor(p) else p


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")


def flatten_report(report: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """A report (a StepLoss dataclass, or any pytree) as its tensor leaves and a function rebuilding it
    from new ones (non-tensor leaves kept as they were)."""
    if dataclasses.is_dataclass(report):
        cls, names = type(report), [f.name for f in dataclasses.fields(report)]
        leaves, spec = pytree.tree_flatten([getattr(report, n) for n in names])
    else:
        cls, names = None, None
        leaves, spec = pytree.tree_flatten(report)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    constants = [None if t else x for x, t in zip(leaves, is_tensor)]

    def rebuild(tensors: list[torch.Tensor]) -> Any:
        it = iter(tensors)
        values = pytree.tree_unflatten([next(it) if t else c for t, c in zip(is_tensor, constants)], spec)
        return cls(**dict(zip(names, values))) if cls is not None else values

    return [x for x, t in zip(leaves, is_tensor) if t], rebuild


@contextlib.contextmanager
def _autocast_cache(enabled: bool) -> Iterator[None]:
    """Autocast's cast cache as eager has it: a weight used twice in one autocast region (a tied or
    shared head) is cast once and its two gradients meet in the low precision, as in eager. The cached
    casts are made inside the trace, so they are graph nodes, not untracked tensors."""
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(enabled)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


_DATA_DEPENDENT = ("_local_scalar_dense", "data-dependent", "value out of a tracing tensor", "data dependent")


def capture_step(model: nn.Module, objective: Callable, batch: Any, *, accumulate: int = 1,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 ) -> tuple[CapturedStep, list]:
    """Trace ``objective(model, batch)`` (its loss ``/ accumulate``) and its gradient as one graph.

    ``batch``: any pytree (a tuple of tensors, a dataclass registered with pytree); its non-tensor
    leaves are baked into the graph (the caller keys its captures on them). ``autocast``: the
    layout's autocast context, traced into the graph. Returns the step and the batch's leaves.
    The trace runs the step once for real; the model's module state is left as before the trace.
    """
    require_capture_apis()
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.utils.stateless import _reparametrize_module

    named = list(model.named_parameters())
    param_names = [n for n, _ in named]
    trainable = [p.requires_grad for _, p in named]
    layouts = [(p.device_mesh, tuple(p.placements), p.shape, p.stride()) if _is_dtensor(p) else None
               for _, p in named]
    buffer_names = [n for n, _ in model.named_buffers()]
    state = ModuleState.collect(model)
    batch_leaves, batch_spec = pytree.tree_flatten(batch)
    found: dict[str, Any] = {}
    tracker = _PathTracker(model)
    cache_enabled = torch.is_autocast_cache_enabled()  # make_fx turns the cache off; eager has it on

    def step(params: list, buffers: list, state_in: list, leaves: list):
        full = []
        for p, layout in zip(params, layouts):
            if layout is not None:
                from torch.distributed.tensor import DTensor

                mesh, placements, shape, stride = layout
                p = DTensor.from_local(p, mesh, placements, run_check=False, shape=shape, stride=stride)
            full.append(p)
        swapped = {**dict(zip(param_names, full)), **dict(zip(buffer_names, buffers))}
        micro = pytree.tree_unflatten(leaves, batch_spec)
        # the backward inside the swap too: an activation checkpoint's recompute runs the modules again
        with _reparametrize_module(model, swapped, tie_weights=True, strict=False), state.bound(state_in):
            with _autocast_cache(cache_enabled), autocast():
                loss, report = objective(model, micro)
                loss = loss / accumulate
            state_out = state.outputs()
            tracker.backward([loss])
            wrt = [p for p, t in zip(params, trainable) if t]
            grads = torch.autograd.grad(loss, wrt, allow_unused=True) if wrt else ()
        found["has_grad"] = [g is not None for g in grads]
        report_tensors, found["rebuild"] = flatten_report(report)
        found["n_report"] = len(report_tensors)
        return [g for g in grads if g is not None] + report_tensors + state_out

    inputs = ([_local(p).detach().requires_grad_(p.requires_grad) for _, p in named],
              [b for _, b in model.named_buffers()], state.read(), batch_leaves)
    saved = state.snapshot()
    try:
        with capturing(), tracker.installed():
            gm = make_fx(step, tracing_mode="real")(*inputs)
    except Exception as e:  # noqa: BLE001 -- re-raised with where it happened
        if any(s in str(e) for s in _DATA_DEPENDENT):
            where = tracker.current or "(outside any module)"
            raise GraphCaptureError(
                f"training.mode=graph: the step reads a tensor's value on the host (a data-dependent "
                f"read) in module {where!r}, which a captured graph cannot replay; use training.mode=eager "
                f"for this model/configuration. ({type(e).__name__}: {str(e).splitlines()[0]})") from e
        raise
    finally:
        state.restore(saved)
    annotate_nodes(gm)
    check_no_large_constants(gm, [p for _, p in named] + [b for _, b in model.named_buffers()])
    captured = CapturedStep(gm, model, param_names, trainable, buffer_names, state, found["has_grad"],
                            found["rebuild"], found["n_report"], layouts)
    return captured, batch_leaves


def check_no_large_constants(gm: torch.fx.GraphModule, tensors: list[torch.Tensor]) -> None:
    """Raise when the graph holds one of ``tensors`` (the model's parameters and buffers) as a constant
    -- it should have been a graph input: replay would read it as a stale copy (frozen tensors of
    another module, e.g. RL's KL reference, may be constants)."""
    storages = {_local(t).untyped_storage().data_ptr() for t in tensors if t.numel() > 0}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if (isinstance(value, torch.Tensor) and value.numel() > 1 and not value.is_meta
                and value.untyped_storage().data_ptr() in storages):
            raise GraphCaptureError(f"captured step holds the model tensor {node.target} of shape "
                                    f"{tuple(value.shape)} as a constant (it was not a graph input)")
