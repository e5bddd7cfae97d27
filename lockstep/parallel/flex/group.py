"""One (bucket, unit) group of FlexShard parameters: one all-gather forward, one reduce-scatter backward.

Forward: each rank packs its pieces (cast to the gather dtype) into one flat buffer of a fixed slot
size ``S`` (the largest rank's total), one ``all_gather`` gives ``[W*S]``, and every whole parameter
is assembled from the ranks' pieces (an ``Owned`` parameter is one rank's piece; ``Shard`` and
``BlockShard`` pieces are concatenated along their dim). An FP8 group (``BlockShard`` + ``fp8``)
packs each rank's blockwise-FP8 bytes and fp32 scales (:mod:`lockstep.parallel.fp8_gather`'s
quantiser, ``block x block`` tiles) as ``uint8`` instead and dequantises after the gather: equal
bit for bit to gathering in the gather dtype and quantising the whole tensor (tiles never straddle
ranks).

Backward (:class:`GatherGroup`): the whole-parameter gradients are packed into ``[W*S]`` in the
reduce dtype (rank r's pieces in slot r), one ``reduce_scatter`` (sum), an ``all_reduce`` (sum) over
the HSDP replicas when there are any, divided by the data-parallel size (the mean, as FSDP2), and
unpacked into the local gradients (an empty piece gets an empty gradient). FP8 gradients pass
straight through (the gradient of the dequantised weight is taken as the weight's).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from lockstep.parallel.flex.collectives import all_gather_flat, reduce_scatter_flat
from lockstep.parallel.flex.layout import FlexParam
from lockstep.parallel.fp8_gather import FP8_DTYPE, dequantize_blockwise, quantize_blockwise


class FlexGroup:
    """Parameters of one bucket inside one unit (every rank builds the same groups in the same order)."""

    def __init__(self, name: str, params: list[nn.Parameter], layouts: list[FlexParam], *,
                 param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
                 replicate_group=None, replicate_world: int = 1, fp8_block: int | None = None) -> None:
        self.name, self.params, self.layouts = name, params, layouts
        self.group, self.rank, self.world = layouts[0].group, layouts[0].rank, layouts[0].world
        self.param_dtype, self.reduce_dtype, self.fp8_block = param_dtype, reduce_dtype, fp8_block
        self.replicate_group, self.replicate_world = replicate_group, replicate_world
        # element layout: numels[r][i] of parameter i's piece on rank r, packed in parameter order
        self.numels = [[lay.piece_numel(r) for lay in layouts] for r in range(self.world)]
        self.slot = max(sum(n) for n in self.numels)
        if fp8_block is not None:
            self.fp8_bytes = [[self._fp8_sizes(lay, r) for lay in layouts] for r in range(self.world)]
            self.fp8_slot = max(sum(a + b for a, b in sizes) for sizes in self.fp8_bytes)
        #: the whole tensors while the unit's forward runs (attribute reads return them), else None
        self.wholes: list[torch.Tensor] | None = None
        #: whole tensors gathered again for backward (resharded after forward), until the reduce
        self.backward_wholes: list[torch.Tensor] | None = None
        self.pending = None  # (out, work) of an issued gather
        self.reshard = True

    def _fp8_sizes(self, lay: FlexParam, rank: int) -> tuple[int, int]:
        rows, cols = lay.piece_shape(rank)
        return rows * cols, math.ceil(rows / self.fp8_block) * math.ceil(cols / self.fp8_block) * 4

    @staticmethod
    def _offsets(sizes: list[int]) -> list[int]:
        out, total = [], 0
        for n in sizes:
            out.append(total)
            total += n
        return out

    # ------------------------------------------------------------------ forward: gather

    def _pack(self) -> torch.Tensor:
        params = self.params
        if self.fp8_block is not None:
            send = torch.zeros(self.fp8_slot, dtype=torch.uint8, device=params[0].device)
            pos = 0
            for p, (q_n, s_n) in zip(params, self.fp8_bytes[self.rank]):
                q, s = quantize_blockwise(p.detach().to(self.param_dtype), self.fp8_block)
                send[pos:pos + q_n] = q.view(torch.uint8).reshape(-1)
                send[pos + q_n:pos + q_n + s_n] = s.reshape(-1).view(torch.uint8)
                pos += q_n + s_n
            return send
        send = torch.zeros(self.slot, dtype=self.param_dtype, device=params[0].device)
        for p, off in zip(params, self._offsets(self.numels[self.rank])):
            send[off:off + p.numel()] = p.detach().reshape(-1)
        return send

    def start_gather(self) -> None:
        """Issue this group's all-gather (asynchronous; no-op when already issued)."""
        if self.pending is None:
            send = self._pack()
            if self.world == 1:
                self.pending = (send, None)
            else:
                self.pending = all_gather_flat(send, self.world, self.group, async_op=True)

    def drop_pending(self) -> None:
        if self.pending is not None:
            out, work = self.pending
            if work is not None:
                work.wait()
            self.pending = None

    def wait_wholes(self) -> list[torch.Tensor]:
        """The whole tensors of the issued (or, if none, a new) gather; no autograd."""
        self.start_gather()
        out, work = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        return self._assemble(out)

    def _assemble(self, out: torch.Tensor) -> list[torch.Tensor]:
        wholes = []
        if self.fp8_block is not None:
            size = self.fp8_slot
            starts = [[r * size + o for o in self._offsets([a + b for a, b in self.fp8_bytes[r]])]
                      for r in range(self.world)]
            for i, lay in enumerate(self.layouts):
                qs, ss = [], []
                for r in range(self.world):
                    q_n, s_n = self.fp8_bytes[r][i]
                    rows, cols = lay.piece_shape(r)
                    pos = starts[r][i]
                    qs.append(out[pos:pos + q_n].view(rows, cols))
                    ss.append(out[pos + q_n:pos + q_n + s_n].clone().view(torch.float32).view(-1, math.ceil(
                        cols / self.fp8_block)))
                q = torch.cat(qs).view(FP8_DTYPE)
                wholes.append(dequantize_blockwise(q, torch.cat(ss), self.fp8_block, self.param_dtype))
            return wholes
        starts = [[r * self.slot + o for o in self._offsets(self.numels[r])] for r in range(self.world)]
        for i, lay in enumerate(self.layouts):
            pieces = [out[starts[r][i]:starts[r][i] + self.numels[r][i]].view(lay.piece_shape(r))
                      for r in range(self.world)]
            wholes.append(lay.assemble(pieces))
        return wholes

    def regather(self) -> list[torch.Tensor]:
        """The whole tensors again for backward (once per backward; freed after the reduce)."""
        if self.backward_wholes is None:
            with torch.no_grad():
                self.backward_wholes = self.wait_wholes()
        return self.backward_wholes

    # ------------------------------------------------------------------ backward: reduce

    def reduce(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
        """Local gradients (mean over the data-parallel ranks) from the whole-parameter gradients."""
        self.backward_wholes = None
        device = self.params[0].device
        send = torch.zeros(self.world * self.slot, dtype=self.reduce_dtype, device=device)
        for r in range(self.world):
            base = r * self.slot
            for g, lay, off, n in zip(grads, self.layouts, self._offsets(self.numels[r]), self.numels[r]):
                if g is not None and n:
                    start, length = lay.piece_of(r)
                    send[base + off:base + off + n] = g.narrow(lay.dim, start, length).reshape(-1)
        mine = reduce_scatter_flat(send, self.world, self.group) if self.world > 1 else send
        if self.replicate_group is not None and self.replicate_world > 1:
            dist.all_reduce(mine, group=self.replicate_group)
        mine = mine / (self.world * self.replicate_world)
        out = []
        for p, off in zip(self.params, self._offsets(self.numels[self.rank])):
            out.append(mine[off:off + p.numel()].view(p.shape).to(p.dtype))
        return out


class GatherGroup(torch.autograd.Function):
    """local pieces -> whole tensors (the group's issued gather); backward: :meth:`FlexGroup.reduce`."""

    @staticmethod
    def forward(ctx, group: FlexGroup, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return tuple(group.wait_wholes())

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, *ctx.group.reduce(grads))
