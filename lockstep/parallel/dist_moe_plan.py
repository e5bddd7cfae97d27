"""The layout of one Dist-MoE call: which rows travel where, and where the owner computes them.

:func:`make_plan` runs once per MoE call, after the router: one blocking ``all_gather`` of every
rank's assignment counts per (chunk, expert) (and token count) tells every rank the exact split
sizes of every exchange of the call, so the data exchanges carry **only the kept rows** (uneven
``all_to_all_single``; no padding on the wire, no second counts exchange).

Per chunk c, on every rank:

* **send layout** -- this rank's kept assignments of the chunk, sorted by global expert (so grouped
  by owner rank), within an expert in token order; ``send_splits[d]`` rows go to rank d;
* **received layout** -- by source rank, then local expert, then the source's order;
  ``recv_splits[s]`` rows come from rank s;
* **owner layout** -- the rows the experts compute on: local expert by local expert, each expert's
  rows in (source rank, position) order followed by zero padding rows up to ``pad_rows(n)`` (at
  least ``ROW_TILE``; in bf16 / fp16 a multiple of it; an expert without rows has none). ``owner_index``
  maps received row i to its owner-layout row; the padding rows are never read back (id -1,
  weight 0: they feed no token).

Why pad at all: this CPU's GEMMs give a row other bits below ~16 rows (GEMV and small-M
micro-kernels; :mod:`lockstep.ops.batch_invariant`), and from 16 rows on, with one thread, a row's
bits depend on neither the row count nor its neighbours (measured for M = 16..700, fp32 and bf16,
D x F from 32 x 64 to 512 x 256: ``mm``, ``bmm`` and ``torch._grouped_mm`` agree bit for bit; with 2
threads bf16 at 512 x 256 splits some row counts, multiples of 16 included, otherwise). So a group
of fewer than ``ROW_TILE`` rows is padded to ``ROW_TILE``, which keeps every row's bits independent
of the chunking -- instead of sizing every expert's slot to the busiest expert's count. In bf16 /
fp16 the groups are padded to ``ROW_TILE`` multiples: oneDNN builds a kernel per new row count
(~1 ms each; see ``_CPU_ROW_BUCKET`` in :mod:`lockstep.models.common.moe`), so the set of row counts
is kept small.

Capacity (``capacity_factor``): 0 is **no-drop** (every assignment is kept); ``f > 0`` keeps at most
``ceil(f * chunk_tokens * k / E)`` rows per (source rank, expert, chunk), the earliest tokens
first, and drops the rest (counted; deterministic given the routing; depends on the chunking).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist

#: the owner pads each expert's rows of a chunk to a multiple of this (see the module docstring)
ROW_TILE = 16


def pad_rows(n: torch.Tensor, multiple: int) -> torch.Tensor:
    """Rows the owner computes for ``n`` real rows of an expert: 0, or at least ROW_TILE and ``n``
    rounded up to ``multiple``."""
    return torch.where(n > 0, ((n + multiple - 1) // multiple * multiple).clamp(min=ROW_TILE), 0)


def row_multiple(dtype: torch.dtype) -> int:
    """What the owner rounds each expert's group up to in ``dtype`` (module docstring)."""
    return ROW_TILE if dtype in (torch.bfloat16, torch.float16) else 1


def _segments(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n in zip(starts, lengths))``, vectorised."""
    lengths = lengths.flatten()
    total = int(lengths.sum())
    first = torch.repeat_interleave(starts.flatten(), lengths, output_size=total)
    offset_in = torch.arange(total) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths, output_size=total)
    return first + offset_in


@dataclasses.dataclass
class ChunkPlan:
    """One chunk's layouts (module docstring)."""

    assignment: torch.Tensor  # kept assignment ids a = t * k + j in send order
    send_splits: list  # rows to each rank
    recv_splits: list  # rows from each rank
    owner_index: torch.Tensor  # received row -> owner-layout row
    group_offsets: torch.Tensor  # int32 [n_local]: end of each local expert's (padded) group
    owner_rows: int  # padded rows the owner computes
    kept_local: torch.Tensor  # [ep, n_local] kept rows from each source to each local expert
    padded: torch.Tensor  # [n_local] rows the owner computes per local expert

    @property
    def n_send(self) -> int:
        return self.assignment.numel()

    @property
    def n_recv(self) -> int:
        return self.owner_index.numel()


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
    capacity: int  # rows kept per (source rank, expert, chunk); no-drop: the largest count
    counts: torch.Tensor  # [ep, C, E] assignments per source rank, chunk, expert (before drops)
    kept: torch.Tensor  # [ep, C, E] after drops
    chunks: list  # ChunkPlan per chunk

    @property
    def dropped(self) -> int:
        return int((self.counts - self.kept).sum())

    def dropped_assignments(self) -> torch.Tensor:
        """This rank's dropped assignments ``t * k + j`` (token t's j-th expert), ascending."""
        kept = torch.zeros(self.n_tokens * self.top_k, dtype=torch.bool)
        for chunk in self.chunks:
            kept[chunk.assignment] = True
        return (~kept).nonzero().flatten()

    def canonical_rows(self) -> tuple[torch.Tensor, list[int]]:
        """Every local expert's real rows as indices into the chunks' owner layouts concatenated,
        expert by expert, each in the order (source rank, chunk, position) = (source, token); and
        the count per expert."""
        chunk_start = 0
        starts, lengths = [], []
        for chunk in self.chunks:
            k = chunk.kept_local  # [ep, nl]
            group_start = chunk.group_offsets.to(torch.int64) - chunk.padded
            starts.append(chunk_start + group_start.unsqueeze(0) + k.cumsum(0) - k)
            lengths.append(k)
            chunk_start += chunk.owner_rows
        starts_t = torch.stack(starts, -1).transpose(0, 1)  # [nl, ep, C]
        lengths_t = torch.stack(lengths, -1).transpose(0, 1)
        return _segments(starts_t, lengths_t), lengths_t.sum((1, 2)).tolist()


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    if hasattr(dist, "all_gather_single"):  # all_gather_into_tensor's newer name (warns on the old one)
        dist.all_gather_single(out, inp, group=group)
    else:
        dist.all_gather_into_tensor(out, inp, group=group)


def _chunk_plan(kept_c: torch.Tensor, assignment: torch.Tensor, rank: int, ep: int, n_local: int,
                multiple: int) -> ChunkPlan:
    """``kept_c [ep, E]``: kept rows per (source, global expert) in this chunk."""
    per_rank = kept_c.view(ep, ep, n_local)  # [source, destination, local expert]
    k = per_rank[:, rank]  # [ep(source), nl] what I receive
    padded = pad_rows(k.sum(0), multiple)
    group_end = padded.cumsum(0)
    recv_base = (group_end - padded).unsqueeze(0) + k.cumsum(0) - k  # owner row of (source, expert)'s first
    return ChunkPlan(assignment, per_rank[rank].sum(1).tolist(), k.sum(1).tolist(), _segments(recv_base, k),
                     group_end.to(torch.int32), int(padded.sum()), k, padded)


def make_plan(indices: torch.Tensor, n_chunks: int, n_local: int, group, capacity_factor: float,
              recorder, dtype: torch.dtype = torch.float32) -> Plan:
    """The layout of ``indices [N, k]`` (global expert ids) for experts computing in ``dtype``;
    ``recorder.blocking`` gets the blocking counts gather (module docstring)."""
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
    recorder.blocking(t0, (ep - 1) * mine.numel() * mine.element_size())
    gathered = gathered.view(ep, -1)
    counts = gathered[:, :-1].reshape(ep, C, n_experts)
    if capacity_factor > 0:
        biggest = int(gathered[:, -1].max())
        capacity = math.ceil(capacity_factor * math.ceil(biggest / C) * k / n_experts)
        kept = counts.clamp(max=capacity)
    else:
        capacity, kept = int(counts.max()) if counts.numel() else 0, counts
    chunks = []
    for c in range(C):
        lo, hi = c * S * k, min((c + 1) * S, n_tokens) * k
        e = flat[lo:hi]
        order = e.argsort(stable=True)
        e_sorted = e[order]
        n_c = counts[rank, c]
        pos = torch.arange(e.numel()) - (n_c.cumsum(0) - n_c)[e_sorted]
        chunks.append(_chunk_plan(kept[:, c], (order + lo)[pos < capacity] if capacity_factor > 0 else order + lo,
                                  rank, ep, n_local, row_multiple(dtype)))
    return Plan(n_tokens, k, C, S, ep, n_local, rank * n_local, capacity, counts, kept, chunks)
