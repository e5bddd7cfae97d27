"""The autograd functions and the chunk pipeline of the Dist-MoE routed-experts operation.

:mod:`lockstep.parallel.dist_moe` describes the operation; this file holds its mechanics:

* :class:`Plan` -- one call's fixed-capacity layout: which (token, expert) assignment goes to which
  slot of which chunk's send buffer ``[ep, n_local, R, D]`` (flattened to ``[E * R, D]``, slot
  ``e * R + pos``), which received rows are real (the rest are padding: zero rows, expert id -1,
  weight 0), and the canonical row order of every local expert for the weight gradients;
* :class:`Dispatch` -- builds every chunk's send buffer and issues chunk 0's dispatch (async); its
  backward waits for the returned input gradients and scatters them onto the tokens;
* :class:`ExpertsCombine` -- the pipelined experts: dispatch of chunk k+1 issued before chunk k's
  experts run, combine of chunk k issued right after (async), the weighted sum once they land; its
  backward runs the same pipeline in reverse chunk order and computes the weight gradients once, in
  the canonical order, while the last input gradients travel back;
* :class:`Recorder` -- per-call wait / communication times (the metrics) and, when a test enables
  :func:`record_timeline`, the timeline of collective issue / wait and compute spans.

Bits. The expert matmuls are one ``bmm`` over ``[n_local, ep * R, D]`` with R a multiple of
``ROW_TILE`` rows: a row's bits do not depend on R or its neighbours there (measured on this CPU's
MKL / oneDNN, fp32 and bf16, 1 and 2 threads; :mod:`lockstep.ops.batch_invariant` explains why row
counts below ~16 are different), so padding and chunking leave every row's forward and input
gradient unchanged; the weight gradients sum each expert's real rows in one ``mm`` in the order
(source rank, token), whatever the chunks or the capacity. Hence ``ep_chunks`` 1, 2, 4 and no-drop
capacities of any size give bitwise-equal losses and gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time

import torch
import torch.distributed as dist

#: padded capacities are multiples of this many rows (fixed-shape bmm rows: see the module docstring)
ROW_TILE = 16

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

    def issue(self, out: torch.Tensor, inp: torch.Tensor, group, kind: str, chunk: int):
        """Start an equal-split ``all_to_all_single`` of ``inp`` into ``out`` (async); returns the handle."""
        t0 = time.perf_counter()
        work = dist.all_to_all_single(out, inp, group=group, async_op=True)
        _event("issue", kind, self.layer, chunk, t0, t0)
        base = kind.removesuffix("_bwd")

        def done(_fut, t0=t0):
            t1 = time.perf_counter()
            with self._lock:
                self.totals[f"{base}_s"] += t1 - t0
            _event("done", kind, self.layer, chunk, t0, t1)

        work.get_future().add_done_callback(done)
        return (work, kind, chunk)

    def wait(self, handle) -> None:
        work, kind, chunk = handle
        t0 = time.perf_counter()
        work.wait()
        t1 = time.perf_counter()
        with self._lock:
            self.totals[f"{kind.removesuffix('_bwd')}_wait_s"] += t1 - t0
        _event("wait", kind, self.layer, chunk, t0, t1)

    def blocking(self, seconds: float) -> None:
        """The plan's synchronous counts exchange (every rank arrives there before any data moves)."""
        with self._lock:
            self.totals["sync_wait_s"] += seconds

    @contextlib.contextmanager
    def compute(self, kind: str, chunk: int):
        t0 = time.perf_counter()
        yield
        _event("compute", kind, self.layer, chunk, t0, time.perf_counter())

    def pop(self) -> dict[str, float]:
        with self._lock:
            out, self.totals = self.totals, {k: 0.0 for k in self.totals}
        return out


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    if hasattr(dist, "all_gather_single"):  # all_gather_into_tensor's newer name (warns on the old one)
        dist.all_gather_single(out, inp, group=group)
    else:
        dist.all_gather_into_tensor(out, inp, group=group)


@dataclasses.dataclass
class Plan:
    """One call's layout over the ep group (host-side; see the module docstring)."""

    n_tokens: int
    top_k: int
    n_chunks: int
    chunk_tokens: int
    ep: int
    n_local: int
    offset: int  # this rank's first global expert
    capacity: int  # rows kept per (source rank, expert, chunk)
    rows: int  # R: capacity padded to ROW_TILE
    counts: torch.Tensor  # [ep, C, E] assignments per source rank, chunk, expert (before drops)
    kept: torch.Tensor  # [ep, C, E] after drops
    chunks: list  # per chunk: (token range start, kept assignment ids a = t * k + j, slots)

    @property
    def dropped(self) -> int:
        return int((self.counts - self.kept).sum())

    def dropped_assignments(self) -> torch.Tensor:
        """This rank's dropped assignments ``t * k + j`` (token t's j-th expert), ascending."""
        kept = torch.zeros(self.n_tokens * self.top_k, dtype=torch.bool)
        for _, assignment, _ in self.chunks:
            kept[assignment] = True
        return (~kept).nonzero().flatten()

    def canonical_rows(self) -> tuple[torch.Tensor, list[int]]:
        """Every local expert's real rows as indices into the chunks' received layouts concatenated
        and flattened (``[n_local * C * ep * R]``: expert, chunk, source, position), expert by expert,
        each in the order (source rank, chunk, position) = (source, token); and the count per expert."""
        R, ep, C, nl = self.rows, self.ep, self.n_chunks, self.n_local
        kept = self.kept[:, :, self.offset:self.offset + nl].permute(2, 0, 1)  # [nl, ep, C]
        valid = torch.arange(R).view(1, 1, 1, R) < kept.unsqueeze(-1)  # [nl, ep, C, R]
        index = (torch.arange(nl).view(nl, 1, 1, 1) * (C * ep * R) + torch.arange(C).view(1, 1, C, 1) * (ep * R)
                 + torch.arange(ep).view(1, ep, 1, 1) * R + torch.arange(R).view(1, 1, 1, R))
        return index[valid], valid.flatten(1).sum(1).tolist()


def make_plan(indices: torch.Tensor, n_chunks: int, n_local: int, group, capacity_factor: float,
              recorder: Recorder) -> Plan:
    """The fixed-capacity layout of ``indices [N, k]`` (global expert ids). One blocking
    ``all_gather`` of the per-(chunk, expert) counts tells every rank what it will receive and, in the
    no-drop mode (``capacity_factor == 0``), the capacity: the largest count any rank sends to any
    expert in any chunk, so no assignment is dropped. With ``capacity_factor > 0`` the capacity is
    ``ceil(factor * chunk_tokens * k / E)`` (chunk_tokens from the largest rank) and the assignments
    past it are dropped: within a (chunk, expert), the earliest tokens keep their slots."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    n_tokens, k = indices.shape
    n_experts = ep * n_local
    C = n_chunks  # the same on every rank (a rank with fewer tokens has empty chunks)
    S = math.ceil(n_tokens / C) if n_tokens else 0
    flat = indices.reshape(-1).to(torch.int64).cpu()
    chunk_of = torch.arange(flat.numel()) // k // max(S, 1)
    local = torch.bincount(chunk_of * n_experts + flat, minlength=C * n_experts)
    mine = torch.cat([local, torch.tensor([n_tokens])]).to(torch.int64)
    gathered = torch.empty(ep * mine.numel(), dtype=torch.int64)
    t0 = time.perf_counter()
    _all_gather(gathered, mine, group)
    recorder.blocking(time.perf_counter() - t0)
    gathered = gathered.view(ep, -1)
    counts = gathered[:, :-1].reshape(ep, C, n_experts)
    if capacity_factor > 0:
        biggest = int(gathered[:, -1].max())
        capacity = math.ceil(capacity_factor * math.ceil(biggest / C) * k / n_experts)
        kept = counts.clamp(max=capacity)
    else:
        capacity, kept = int(counts.max()) if counts.numel() else 0, counts
    rows = max(ROW_TILE, math.ceil(capacity / ROW_TILE) * ROW_TILE)
    chunks = []
    for c in range(C):
        lo, hi = c * S * k, min((c + 1) * S, n_tokens) * k
        e = flat[lo:hi]
        order = e.argsort(stable=True)
        e_sorted = e[order]
        n_c = counts[rank, c]
        pos = torch.arange(e.numel()) - (n_c.cumsum(0) - n_c)[e_sorted]
        keep = pos < capacity
        chunks.append((c * S, (order + lo)[keep], e_sorted[keep] * rows + pos[keep]))
    return Plan(n_tokens, k, C, S, ep, n_local, rank * n_local, capacity, rows, counts, kept, chunks)


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
    saved: list = dataclasses.field(default_factory=list)  # per chunk (x_recv, gate, up) at the owner
    y_rows: list = dataclasses.field(default_factory=list)  # per chunk: expert outputs of kept assignments
    weights_rows: list = dataclasses.field(default_factory=list)  # per chunk: their routing weights
    x_dtype: torch.dtype = torch.float32
    dim: int = 0


def _to_owner_layout(buf: torch.Tensor, ep: int, n_local: int, rows: int) -> torch.Tensor:
    """``[ep(src), n_local, R, D]`` flat -> ``[n_local, ep * R, D]``: each local expert's rows."""
    return buf.view(ep, n_local, rows, -1).transpose(0, 1).reshape(n_local, ep * rows, -1)


def _from_owner_layout(t: torch.Tensor, ep: int, n_local: int, rows: int) -> torch.Tensor:
    return t.view(n_local, ep, rows, -1).transpose(0, 1).reshape(ep * n_local * rows, -1)


class Dispatch(torch.autograd.Function):
    """``x [N, D]`` -> an empty marker tensor; fills every chunk's send buffer and issues chunk 0's
    dispatch. Backward: waits for the input gradients of every chunk and scatters them onto x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: CallState) -> torch.Tensor:
        plan, ep, nl, R = state.plan, state.plan.ep, state.plan.n_local, state.plan.rows
        state.x_dtype, state.dim = x.dtype, x.shape[-1]
        xs = x.detach().to(state.dtype)
        for start, assignment, slots in plan.chunks:
            buf = xs.new_zeros(ep * nl * R, x.shape[-1])
            buf.index_copy_(0, slots, xs[assignment // plan.top_k])
            state.send.append(buf)
            state.recv.append(torch.empty_like(buf))
        state.handles["dispatch", 0] = state.recorder.issue(state.recv[0], state.send[0], state.group, "dispatch", 0)
        ctx.state = state
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _marker_grad):
        state = ctx.state
        plan = state.plan
        dx = torch.zeros(plan.n_tokens, state.dim, dtype=state.x_dtype)
        for c, (start, assignment, slots) in enumerate(plan.chunks):
            state.recorder.wait(state.handles.pop(("dispatch_bwd", c)))
            rows = state.send[c][slots]  # the returned input gradients, in the send layout
            dx.index_add_(0, assignment // plan.top_k, rows.to(state.x_dtype))
        ctx.state = None
        return dx, None


def _expert_forward(x: torch.Tensor, w1, w2, w3, act):
    gate = torch.bmm(x, w1.mT)
    up = torch.bmm(x, w3.mT)
    return gate, up, torch.bmm(act(gate, up), w2.mT)


class ExpertsCombine(torch.autograd.Function):
    """``(marker, weights [N, k], w1, w2, w3)`` -> the routed output ``[N, D]`` (weighted sum of the
    kept assignments' expert outputs); see the module docstring for the pipeline."""

    @staticmethod
    def forward(ctx, marker, weights, w1, w2, w3, state: CallState):
        plan, rec, group = state.plan, state.recorder, state.group
        ep, nl, R, C = plan.ep, plan.n_local, plan.rows, plan.n_chunks
        dt = state.dtype
        ws = [w.detach().to(dt) for w in (w1, w2, w3)]
        back = []
        with torch.autocast(marker.device.type, enabled=False):
            for c in range(C):
                if c + 1 < C:  # the next chunk travels while this one computes
                    state.handles["dispatch", c + 1] = rec.issue(state.recv[c + 1], state.send[c + 1], group,
                                                                 "dispatch", c + 1)
                rec.wait(state.handles.pop(("dispatch", c)))
                with rec.compute("experts", c):
                    xr = _to_owner_layout(state.recv[c], ep, nl, R)
                    gate, up, y = _expert_forward(xr, *ws, state.act)
                if state.needs_grad:
                    state.saved.append((xr, gate, up))
                out_buf = _from_owner_layout(y, ep, nl, R)
                back.append(torch.empty_like(out_buf))
                state.handles["combine", c] = rec.issue(back[c], out_buf, group, "combine", c)
            out = torch.zeros(plan.n_tokens, state.dim, dtype=state.x_dtype)
            w_flat = weights.detach().reshape(-1)
            for c, (start, assignment, slots) in enumerate(plan.chunks):
                rec.wait(state.handles.pop(("combine", c)))
                y_rows = back[c][slots]
                if state.needs_grad:
                    state.y_rows.append(y_rows)
                    state.weights_rows.append(w_flat[assignment])
                routed = y_rows * w_flat[assignment].unsqueeze(1).to(y_rows.dtype)
                out.index_add_(0, assignment // plan.top_k, routed.to(state.x_dtype))
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
        ep, nl, R, C, dt = plan.ep, plan.n_local, plan.rows, plan.n_chunks, state.dtype
        w1, w2, w3 = ctx.saved_tensors
        ws = [w.detach().to(dt) for w in (w1, w2, w3)]
        grad_out = grad_out.contiguous()
        # sender side: gradients of the routing weights and of the expert outputs, per chunk
        grad_w = torch.zeros(ctx.weights_shape, dtype=ctx.weights_dtype).reshape(-1)
        grad_send = []
        for c, (start, assignment, slots) in enumerate(plan.chunks):
            g = grad_out[assignment // plan.top_k].to(dt)
            grad_w[assignment] = (g * state.y_rows[c]).sum(1).to(grad_w.dtype)
            buf = g.new_zeros(ep * nl * R, state.dim)
            buf.index_copy_(0, slots, g * state.weights_rows[c].unsqueeze(1).to(dt))
            grad_send.append(buf)
        grad_recv = [torch.empty_like(b) for b in grad_send]
        keep = {name: [None] * C for name in ("x", "act", "gy", "dgate", "dup")}
        order = list(reversed(range(C)))
        state.handles["combine_bwd", order[0]] = rec.issue(grad_recv[order[0]], grad_send[order[0]], group,
                                                           "combine_bwd", order[0])
        for i, c in enumerate(order):
            if i + 1 < C:
                nxt = order[i + 1]
                state.handles["combine_bwd", nxt] = rec.issue(grad_recv[nxt], grad_send[nxt], group,
                                                              "combine_bwd", nxt)
            rec.wait(state.handles.pop(("combine_bwd", c)))
            with rec.compute("experts_bwd", c):
                xr, gate, up = state.saved[c]
                gy = _to_owner_layout(grad_recv[c], ep, nl, R)
                with torch.enable_grad():
                    g_leaf, u_leaf = gate.detach().requires_grad_(), up.detach().requires_grad_()
                    act = state.act(g_leaf, u_leaf)
                    dgate, dup = torch.autograd.grad(act, (g_leaf, u_leaf), torch.bmm(gy, ws[1]))
                dx = torch.bmm(dgate, ws[0]) + torch.bmm(dup, ws[2])
            # the input gradients go back into the (no longer needed) send buffer of this chunk
            dx_buf = _from_owner_layout(dx, ep, nl, R)
            state.handles["dispatch_bwd", c] = rec.issue(state.send[c], dx_buf, group, "dispatch_bwd", c)
            for name, t in (("x", xr), ("act", act.detach()), ("gy", gy), ("dgate", dgate), ("dup", dup)):
                keep[name][c] = t
        # weight gradients: each expert's real rows in the canonical order, one mm each
        with rec.compute("weight_grads", -1):
            rows, per_expert = plan.canonical_rows()
            compact = {name: torch.cat(ts, dim=1).flatten(0, 1)[rows].split(per_expert)
                       for name, ts in keep.items()}
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
