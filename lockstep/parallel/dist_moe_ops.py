"""The autograd functions and the chunk pipeline of the Dist-MoE routed-experts operation.

:mod:`lockstep.parallel.dist_moe` describes the operation, :mod:`lockstep.parallel.dist_moe_plan`
one call's layout (exact split sizes, the owner's padded per-expert groups); this file holds the
mechanics:

* :class:`Dispatch` -- builds every chunk's send rows (the kept assignments, in the plan's send
  order) and issues chunk 0's dispatch (async, uneven ``all_to_all_single``); its backward waits for
  the returned input gradients and scatters them onto the tokens;
* :class:`ExpertsCombine` -- the pipelined experts: dispatch of chunk k+1 issued before chunk k's
  experts run, combine of chunk k issued right after (async), the weighted sum once they land; its
  backward runs the same pipeline in reverse chunk order and computes the weight gradients once, in
  the canonical order, while the last input gradients travel back;
* :class:`Recorder` -- per-call wait / communication times (the metrics) and, when a test enables
  :func:`record_timeline`, the timeline of collective issue / wait and compute spans;
* :func:`emulated_link` -- benchmarks and tests only: ``LOCKSTEP_EP_LINK_EMULATION="LATENCY_US,MB_PER_S"``
  (read when a layer's Recorder is made) makes each exchange complete no earlier than its issue time
  + latency + remote bytes / bandwidth, in real time: after gloo's own wait, ``wait`` sleeps until
  that deadline. Sleeping costs no CPU, as a NIC / NVLink copy engine costs the host none; gloo's
  loopback copies still run on the cores. Remote bytes: the larger of the rows this rank sends to
  and receives from other ranks (a full-duplex link per rank), times the row size; the rank's
  exchanges queue on its one link (a dispatch and a combine in flight together share its
  bandwidth), so the deadline is ``max(issue, link free) + bytes / bandwidth + latency``. The plan's
  blocking counts gather uses the link too. Numerics are untouched; unset, nothing changes.

Bits. The owner computes each local expert's rows of a chunk as one group of
``torch._grouped_mm`` (a loop of ``mm`` where that is missing or the strides do not suit it), a group
of fewer than ``ROW_TILE`` rows padded to ``ROW_TILE`` (:mod:`lockstep.parallel.dist_moe_plan`): from
16 rows on a row's bits depend on neither the row count nor its neighbours (measured on this CPU's
MKL / oneDNN with one thread per rank, fp32 and bf16), so the chunking leaves every row's forward
and input gradient unchanged; the weight gradients sum each expert's real rows in one ``mm`` in the
order (source rank, token), whatever the chunks or the capacity. Hence ``ep_chunks`` 1, 2, 4 and
every capacity that drops nothing give bitwise-equal losses and gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time

import torch
import torch.distributed as dist

from lockstep.config.base import ConfigError, require
from lockstep.parallel.dist_moe_plan import ChunkPlan, Plan

LINK_ENV = "LOCKSTEP_EP_LINK_EMULATION"

_TIMELINE: list | None = None
_TIMELINE_LOCK = threading.Lock()


@contextlib.contextmanager
def record_timeline():
    """Record every Dist-MoE event of this process while the block runs: yields a list of
    ``(event, kind, layer, chunk, t0, t1)`` -- ``event`` is "issue" (t0 = t1), "wait" (blocked in
    ``wait``), "done" (the collective completed, from its future's callback) or "compute" (an expert
    span); ``kind`` is "dispatch" / "combine" / "experts" with a "_bwd" suffix in backward."""
    global _TIMELINE
    events: list = []
    _TIMELINE = events
    try:
        yield events
    finally:
        _TIMELINE = None


def _event(event: str, kind: str, layer: int, chunk: int, t0: float, t1: float) -> None:
    if _TIMELINE is not None:
        with _TIMELINE_LOCK:
            _TIMELINE.append((event, kind, layer, chunk, t0, t1))


@dataclasses.dataclass
class EmulatedLink:
    """One rank's link, costing the host no CPU: an exchange's bytes cross it after the ones issued
    before it (one queue: concurrent exchanges share the bandwidth) at ``bytes_per_s``, and arrive
    ``latency_s`` after that."""

    latency_s: float
    bytes_per_s: float
    _free_at: float = dataclasses.field(default=0.0, compare=False, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, compare=False, repr=False)

    def deadline(self, t0: float, nbytes: int) -> float:
        """When an exchange of ``nbytes`` remote bytes issued at ``t0`` completes (queued behind the
        earlier ones)."""
        with self._lock:
            self._free_at = max(t0, self._free_at) + nbytes / self.bytes_per_s
            return self._free_at + self.latency_s


_LINKS: dict[str, EmulatedLink] = {}


def emulated_link() -> EmulatedLink | None:
    """This process's link as ``LOCKSTEP_EP_LINK_EMULATION="LATENCY_US,MB_PER_S"`` asks for (module
    docstring; every layer gets the same one); None if unset."""
    spec = os.environ.get(LINK_ENV)
    if not spec:
        return None
    if spec not in _LINKS:
        try:
            latency_us, mb_per_s = (float(v) for v in spec.split(","))
        except ValueError:
            raise ConfigError(f"{LINK_ENV}: expected 'LATENCY_US,MB_PER_S', got {spec!r}") from None
        require(latency_us >= 0 and mb_per_s > 0, LINK_ENV, f"needs latency >= 0 and bandwidth > 0, got {spec!r}")
        _LINKS[spec] = EmulatedLink(latency_us / 1e6, mb_per_s * 1e6)
    return _LINKS[spec]


def remote_bytes(splits: tuple[list, list], rank: int, row_bytes: int) -> int:
    """Bytes over this rank's link for an exchange with ``splits = (output, input split sizes)``:
    the larger of what it receives from and sends to the other ranks."""
    out_splits, in_splits = splits
    return max(sum(out_splits) - out_splits[rank], sum(in_splits) - in_splits[rank]) * row_bytes


class Recorder:
    """Communication times of one MoE layer, summed until :meth:`pop`: ``dispatch`` / ``combine``
    each with the time blocked in ``wait`` (exposed) and the issue-to-completion time (total), and
    ``sync_wait_s``: the blocking counts exchange of the plan, which also absorbs the other ranks'
    lateness (load imbalance, not transfer), kept apart from the exposed communication."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.totals = {"dispatch_wait_s": 0.0, "combine_wait_s": 0.0, "dispatch_s": 0.0, "combine_s": 0.0,
                       "sync_wait_s": 0.0}
        self._lock = threading.Lock()
        self.link = emulated_link()

    def deadline(self, t0: float, inp: torch.Tensor, splits: tuple[list, list], group) -> float:
        """When the emulated link lets an exchange of ``inp``'s rows, issued at ``t0``, complete."""
        row_bytes = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        return self.link.deadline(t0, remote_bytes(splits, dist.get_rank(group), row_bytes))

    def issue(self, out: torch.Tensor, inp: torch.Tensor, splits: tuple[list, list], group, kind: str,
              chunk: int):
        """Start an ``all_to_all_single`` of ``inp`` into ``out`` (async), ``splits = (output split
        sizes, input split sizes)``; returns the handle."""
        t0 = time.perf_counter()
        work = dist.all_to_all_single(out, inp, output_split_sizes=splits[0], input_split_sizes=splits[1],
                                      group=group, async_op=True)
        _event("issue", kind, self.layer, chunk, t0, t0)
        base = kind.removesuffix("_bwd")
        deadline = None if self.link is None else self.deadline(t0, inp, splits, group)

        def done(_fut, t0=t0):
            t1 = time.perf_counter() if deadline is None else max(time.perf_counter(), deadline)
            with self._lock:
                self.totals[f"{base}_s"] += t1 - t0
            _event("done", kind, self.layer, chunk, t0, t1)

        work.get_future().add_done_callback(done)
        return (work, kind, chunk, deadline)

    def wait(self, handle) -> None:
        work, kind, chunk, deadline = handle
        t0 = time.perf_counter()
        work.wait()
        t1 = time.perf_counter()
        if deadline is not None and t1 < deadline:
            time.sleep(deadline - t1)
            t1 = time.perf_counter()
        with self._lock:
            self.totals[f"{kind.removesuffix('_bwd')}_wait_s"] += t1 - t0
        _event("wait", kind, self.layer, chunk, t0, t1)

    def blocking(self, t0: float, nbytes: int) -> None:
        """The plan's synchronous counts exchange of ``nbytes`` remote bytes, started at ``t0`` and
        just returned (every rank arrives there before any data moves); the emulated link holds it
        to its deadline too."""
        t1 = time.perf_counter()
        deadline = None if self.link is None else self.link.deadline(t0, nbytes)
        if deadline is not None and t1 < deadline:
            time.sleep(deadline - t1)
            t1 = time.perf_counter()
        with self._lock:
            self.totals["sync_wait_s"] += t1 - t0

    @contextlib.contextmanager
    def compute(self, kind: str, chunk: int):
        t0 = time.perf_counter()
        yield
        _event("compute", kind, self.layer, chunk, t0, time.perf_counter())

    def pop(self) -> dict[str, float]:
        with self._lock:
            out, self.totals = self.totals, {k: 0.0 for k in self.totals}
        return out


@dataclasses.dataclass
class CallState:
    """What one call's forward leaves for its backward (and Dispatch for ExpertsCombine)."""

    plan: Plan
    group: object
    recorder: Recorder
    act: object  # activation(gate, up)
    dtype: torch.dtype  # compute dtype (the autocast dtype under autocast)
    needs_grad: bool
    send: list = dataclasses.field(default_factory=list)
    recv: list = dataclasses.field(default_factory=list)
    handles: dict = dataclasses.field(default_factory=dict)
    saved: list = dataclasses.field(default_factory=list)  # per chunk (x, gate, up) in the owner layout
    y_rows: list = dataclasses.field(default_factory=list)  # per chunk: expert outputs of kept assignments
    weights_rows: list = dataclasses.field(default_factory=list)  # per chunk: their routing weights
    x_dtype: torch.dtype = torch.float32
    dim: int = 0


def _forward_splits(chunk: ChunkPlan) -> tuple[list, list]:
    """(output, input) split sizes of the sender -> owner exchanges (dispatch, output gradients)."""
    return chunk.recv_splits, chunk.send_splits


def _backward_splits(chunk: ChunkPlan) -> tuple[list, list]:
    """(output, input) split sizes of the owner -> sender exchanges (combine, input gradients)."""
    return chunk.send_splits, chunk.recv_splits


def _to_owner(received: torch.Tensor, chunk: ChunkPlan) -> torch.Tensor:
    """Received rows -> the owner layout (each local expert's rows, zero padding after them)."""
    out = received.new_zeros(chunk.owner_rows, received.shape[-1])
    return out.index_copy_(0, chunk.owner_index, received)


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` rows of expert e (groups ending at ``offsets``) times ``w[e] [K, N]``."""
    aligned = all(t.stride(i) * t.element_size() % 16 == 0 or t.stride(i) == 1
                  for t in (x, w) for i in range(t.dim()))
    if hasattr(torch, "_grouped_mm") and aligned:
        return torch._grouped_mm(x, w, offs=offsets)
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


def _expert_forward(x: torch.Tensor, chunk: ChunkPlan, w1, w2, w3, act):
    gate = _grouped(x, w1.mT, chunk.group_offsets)
    up = _grouped(x, w3.mT, chunk.group_offsets)
    return gate, up, _grouped(act(gate, up), w2.mT, chunk.group_offsets)


class Dispatch(torch.autograd.Function):
    """``x [N, D]`` -> an empty marker tensor; gathers every chunk's send rows and issues chunk 0's
    dispatch. Backward: waits for the input gradients of every chunk and scatters them onto x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: CallState) -> torch.Tensor:
        plan = state.plan
        state.x_dtype, state.dim = x.dtype, x.shape[-1]
        xs = x.detach().to(state.dtype)
        for chunk in plan.chunks:
            state.send.append(xs[chunk.assignment // plan.top_k])
            state.recv.append(xs.new_empty(chunk.n_recv, x.shape[-1]))
        state.handles["dispatch", 0] = state.recorder.issue(state.recv[0], state.send[0],
                                                            _forward_splits(plan.chunks[0]), state.group, "dispatch", 0)
        ctx.state = state
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _marker_grad):
        state = ctx.state
        plan = state.plan
        dx = torch.zeros(plan.n_tokens, state.dim, dtype=state.x_dtype)
        for c, chunk in enumerate(plan.chunks):
            state.recorder.wait(state.handles.pop(("dispatch_bwd", c)))
            # the returned input gradients, in the send order
            dx.index_add_(0, chunk.assignment // plan.top_k, state.send[c].to(state.x_dtype))
        ctx.state = None
        return dx, None


class ExpertsCombine(torch.autograd.Function):
    """``(marker, weights [N, k], w1, w2, w3)`` -> the routed output ``[N, D]`` (weighted sum of the
    kept assignments' expert outputs); see the module docstring for the pipeline."""

    @staticmethod
    def forward(ctx, marker, weights, w1, w2, w3, state: CallState):
        plan, rec, group = state.plan, state.recorder, state.group
        C, dt = plan.n_chunks, state.dtype
        ws = [w.detach().to(dt) for w in (w1, w2, w3)]
        back = []
        with torch.autocast(marker.device.type, enabled=False):
            for c, chunk in enumerate(plan.chunks):
                if c + 1 < C:  # the next chunk travels while this one computes
                    state.handles["dispatch", c + 1] = rec.issue(state.recv[c + 1], state.send[c + 1],
                                                                 _forward_splits(plan.chunks[c + 1]), group,
                                                                 "dispatch", c + 1)
                rec.wait(state.handles.pop(("dispatch", c)))
                with rec.compute("experts", c):
                    x_owner = _to_owner(state.recv[c], chunk)
                    gate, up, y = _expert_forward(x_owner, chunk, *ws, state.act)
                    y_back = y[chunk.owner_index]
                if state.needs_grad:
                    state.saved.append((x_owner, gate, up))
                back.append(y.new_empty(chunk.n_send, y.shape[-1]))
                state.handles["combine", c] = rec.issue(back[c], y_back, _backward_splits(chunk), group, "combine", c)
            out = torch.zeros(plan.n_tokens, state.dim, dtype=state.x_dtype)
            w_flat = weights.detach().reshape(-1)
            for c, chunk in enumerate(plan.chunks):
                rec.wait(state.handles.pop(("combine", c)))
                y_rows = back[c]
                if state.needs_grad:
                    state.y_rows.append(y_rows)
                    state.weights_rows.append(w_flat[chunk.assignment])
                routed = y_rows * w_flat[chunk.assignment].unsqueeze(1).to(y_rows.dtype)
                out.index_add_(0, chunk.assignment // plan.top_k, routed.to(state.x_dtype))
        state.send, state.recv = [t if state.needs_grad else None for t in state.send], []
        ctx.state = state
        ctx.weight_dtypes = [w.dtype for w in (w1, w2, w3)]
        ctx.weights_shape, ctx.weights_dtype = weights.shape, weights.dtype
        ctx.save_for_backward(w1, w2, w3)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        state = ctx.state
        plan, rec, group = state.plan, state.recorder, state.group
        C, dt = plan.n_chunks, state.dtype
        w1, w2, w3 = ctx.saved_tensors
        ws = [w.detach().to(dt) for w in (w1, w2, w3)]
        grad_out = grad_out.contiguous()
        # sender side: gradients of the routing weights and of the expert outputs, per chunk
        grad_w = torch.zeros(ctx.weights_shape, dtype=ctx.weights_dtype).reshape(-1)
        grad_send = []
        for c, chunk in enumerate(plan.chunks):
            g = grad_out[chunk.assignment // plan.top_k].to(dt)
            grad_w[chunk.assignment] = (g * state.y_rows[c]).sum(1).to(grad_w.dtype)
            grad_send.append(g * state.weights_rows[c].unsqueeze(1).to(dt))
        grad_recv = [g.new_empty(chunk.n_recv, state.dim) for g, chunk in zip(grad_send, plan.chunks)]
        keep = {name: [None] * C for name in ("x", "act", "gy", "dgate", "dup")}
        order = list(reversed(range(C)))

        def issue_grads(c):
            state.handles["combine_bwd", c] = rec.issue(grad_recv[c], grad_send[c], _forward_splits(plan.chunks[c]),
                                                        group, "combine_bwd", c)

        issue_grads(order[0])
        for i, c in enumerate(order):
            chunk = plan.chunks[c]
            if i + 1 < C:
                issue_grads(order[i + 1])
            rec.wait(state.handles.pop(("combine_bwd", c)))
            with rec.compute("experts_bwd", c):
                x_owner, gate, up = state.saved[c]
                gy = _to_owner(grad_recv[c], chunk)
                with torch.enable_grad():
                    g_leaf, u_leaf = gate.detach().requires_grad_(), up.detach().requires_grad_()
                    act = state.act(g_leaf, u_leaf)
                    dgate, dup = torch.autograd.grad(act, (g_leaf, u_leaf), _grouped(gy, ws[1], chunk.group_offsets))
                dx = _grouped(dgate, ws[0], chunk.group_offsets) + _grouped(dup, ws[2], chunk.group_offsets)
                dx_back = dx[chunk.owner_index]
            # the input gradients go back into the (no longer needed) send rows of this chunk
            state.handles["dispatch_bwd", c] = rec.issue(state.send[c], dx_back, _backward_splits(chunk), group,
                                                         "dispatch_bwd", c)
            for name, t in (("x", x_owner), ("act", act.detach()), ("gy", gy), ("dgate", dgate), ("dup", dup)):
                keep[name][c] = t
        # weight gradients: each expert's real rows in the canonical order, one mm each
        with rec.compute("weight_grads", -1):
            rows, per_expert = plan.canonical_rows()
            compact = {name: torch.cat(ts)[rows].split(per_expert) for name, ts in keep.items()}
            grads = [torch.zeros(w.shape, dtype=dt) for w in ws]
            for e, n in enumerate(per_expert):
                if n:
                    x_e = compact["x"][e]
                    grads[0][e] = compact["dgate"][e].t().mm(x_e)
                    grads[2][e] = compact["dup"][e].t().mm(x_e)
                    grads[1][e] = compact["gy"][e].t().mm(compact["act"][e])
        state.saved, state.y_rows, state.weights_rows = [], [], []
        grads = [g.to(d) for g, d in zip(grads, ctx.weight_dtypes)]
        ctx.state = None
        return (torch.zeros(0, dtype=state.x_dtype), grad_w.view(ctx.weights_shape), *grads, None)
