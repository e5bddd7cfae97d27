"""Distributed Muon over FlexShard local storage (lockstep.train.muon, ``param._flex``) == one process.

Each parameter's local piece is put on every rank ("owned", "block_shard", "shard") twice: with a small
fake of the FlexParam contract (its own gather) and with the real ``lockstep.parallel.flex.layout.
FlexParam`` (its flat all-gather), without the rest of flex_shard; the test gives both sides
the SAME whole gradients (the distributed side gets ``shard_of(grad)``), steps both Muon optimizers 5
times and checks every rank's local storage is ``torch.equal`` to the same piece of the one-process
parameters: the same whole units are orthogonalised by the same 2-D code, so the bits match. It also
counts ``gather_full`` calls: the matrices a rank holds whole (owned, block_shard of whole heads or of
whole stacked matrices) are updated with no gather; only the fallbacks (block_shard not aligned with
heads, shard) gather. World 2 and 4, one gloo spawn each (gloo, one thread per rank).
"""

import datetime
import math
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.flex.layout import FlexParam
from lockstep.train.muon import Muon, flex_route
from lockstep.train.optim import OptimizerConfig

HEAD_DIM = 4
STEPS = 5


class FakeFlex:
    """The FlexParam contract, enough for the optimizer: a piece ``narrow(dim, offset, length)`` per rank."""

    def __init__(self, placement, global_shape, dim, offset, length, *, block=None, owner=None, world=2, rank=0):
        self.placement, self.global_shape, self.dim, self.offset = placement, tuple(global_shape), dim, offset
        self.length, self.block, self.owner, self.world, self.rank = length, block, owner, world, rank
        self.group, self.bucket, self.gathers = None, placement, 0

    @property
    def is_whole(self):
        return self.length == self.global_shape[self.dim]

    def shard_of(self, whole):
        return whole.narrow(self.dim, self.offset, self.length)

    def gather_full(self, local):
        self.gathers += 1
        if self.placement == "owned":
            whole = local.clone() if self.rank == self.owner else local.new_empty(self.global_shape)
            dist.broadcast(whole, src=self.owner)
            return whole
        lengths = [torch.zeros((), dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(lengths, torch.tensor(self.length))
        slot = max(int(n) for n in lengths)
        padded = torch.zeros(*local.shape[:self.dim], slot, *local.shape[self.dim + 1:], dtype=local.dtype)
        padded.narrow(self.dim, 0, self.length).copy_(local)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return torch.cat([p.narrow(self.dim, 0, int(n)) for p, n in zip(parts, lengths)], self.dim)


def _piece(placement, size, world, rank, block=None, owner=None):
    """(offset, length) of this rank's piece along a dim of ``size``."""
    if placement == "owned":
        return 0, size if rank == owner else 0
    per = -(-size // world) if placement == "shard" else -(-(-(-size // block)) // world) * block
    offset = min(rank * per, size)
    return offset, min(per, size - offset)


class Toy(nn.Module):
    """Muon matrices (per-head wq/wk, whole w1/w2, a stack of 3 experts) and AdamW parameters
    (embedding, norm, a 2-element bias that leaves some ranks of world 4 with 0 elements)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.config = types.SimpleNamespace(resolved_head_dim=HEAD_DIM)
        self.emb = nn.Embedding(10, 8, _weight=torch.randn(10, 8, generator=g))
        self.wq = nn.Parameter(torch.randn(16, 8, generator=g))   # 4 heads
        self.wk = nn.Parameter(torch.randn(8, 8, generator=g))    # 2 heads
        self.wv = nn.Parameter(torch.randn(12, 8, generator=g))   # 3 heads (per-head, block not whole heads)
        self.w1 = nn.Parameter(torch.randn(24, 8, generator=g))
        self.w2 = nn.Parameter(torch.randn(8, 24, generator=g))
        self.experts = nn.Parameter(torch.randn(3, 6, 8, generator=g))
        self.norm = nn.Parameter(torch.ones(8))
        self.bias = nn.Parameter(torch.zeros(2))


PER_HEAD = ["wq", "wk", "wv"]
# per placement kind: name -> (placement, dim, block); None: the AdamW parameters' "shard"
LAYOUTS = {
    "owned": {n: ("owned", 0, None) for n in ("wq", "wk", "wv", "w1", "w2", "experts")},
    # wq/wk: blocks of 2 heads (local, per-head); wv: 6-row blocks cut heads (gather); w1/w2: whole
    # matrices in row blocks (gather; w1's one block of 32 rows is all on rank 0: the others must
    # still join its gather); experts: whole matrices of the stack (local)
    "block_shard": {"wq": ("block_shard", 0, 8), "wk": ("block_shard", 0, 4), "wv": ("block_shard", 0, 6),
                    "w1": ("block_shard", 0, 32), "w2": ("block_shard", 0, 4), "experts": ("block_shard", 0, 1)},
    "shard": {n: ("shard", 0, None) for n in ("wq", "wk", "wv", "w1", "w2", "experts")},
}


class CountingFlexParam(FlexParam):
    """The real contract class (lockstep.parallel.flex.layout), counting its gathers."""

    gathers = 0

    def gather_full(self, local):
        self.gathers += 1
        return super().gather_full(local)


def _flex_model(kind, world, rank, impl="fake"):
    """The Toy model with every parameter replaced by this rank's local storage and its ``_flex``
    (``impl``: "fake" -- :class:`FakeFlex`, or "real" -- FlexParam with its own gather)."""
    model = Toy()
    owners = {}
    for i, name in enumerate(("wq", "wk", "wv", "w1", "w2", "experts")):
        owners[name] = i % world
    for name, p in list(model.named_parameters()):
        placement, dim, block = LAYOUTS[kind].get(name, ("shard", 0, None))
        owner = owners.get(name) if placement == "owned" else None
        offset, length = _piece(placement, p.shape[dim], world, rank, block, owner)
        if impl == "fake":
            flex = FakeFlex(placement, p.shape, dim, offset, length, block=block, owner=owner, world=world,
                            rank=rank)
        else:
            flex = CountingFlexParam(placement, tuple(p.shape), dim, offset, block, owner, dist.group.WORLD, rank,
                                     world, kind, fqn=name)
            assert flex.piece_of(rank) == (offset, length), (name, flex.piece_of(rank), (offset, length))
        local = nn.Parameter(flex.shard_of(p.detach()).clone())
        local._flex = flex
        module, attr = (model.emb, "weight") if name == "emb.weight" else (model, name)
        setattr(module, attr, local)
    return model


def _muon(model):
    return OptimizerConfig(name="muon", lr=0.02, weight_decay=0.1, muon_per_head=PER_HEAD).build(model)


def _grads(model, step):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p._flex.global_shape if hasattr(p, "_flex") else p.shape, generator=g)
            for n, p in model.named_parameters()}


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    res = {}
    for kind, impl in [(kind, impl) for kind in LAYOUTS for impl in ("fake", "real")]:
        one, flex = Toy(), _flex_model(kind, world, rank, impl)
        opt_one, opt_flex = _muon(one), _muon(flex)
        for step in range(STEPS):
            grads = _grads(one, step)
            for n, p in one.named_parameters():
                p.grad = grads[n].clone()
            for n, p in flex.named_parameters():
                p.grad = p._flex.shard_of(grads[n]).clone()
            opt_one.step()
            opt_flex.step()
        whole = dict(one.named_parameters())
        res[kind, impl] = {n: (torch.equal(p.detach(), p._flex.shard_of(whole[n].detach())), p._flex.gathers // STEPS,
                         tuple(p.shape)) for n, p in flex.named_parameters()}
    dist.destroy_process_group()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, computed_once):
    world = request.param
    tmp = computed_once(f"muon flex spawn world {world}", lambda d: mp.spawn(
        _worker, args=(world, str(d / "init"), str(d)), nprocs=world, join=True))
    return world, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


# gathers per step of each Muon matrix (AdamW parameters never gather)
EXPECTED_GATHERS = {
    "owned": dict.fromkeys(("wq", "wk", "wv", "w1", "w2", "experts"), 0),
    "block_shard": {"wq": 0, "wk": 0, "wv": 1, "w1": 1, "w2": 1, "experts": 0},
    "shard": dict.fromkeys(("wq", "wk", "wv", "w1", "w2", "experts"), 1),
}


@pytest.mark.slow
@pytest.mark.xdist_group("parallel")
@pytest.mark.parametrize("impl", ["fake", "real"])
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_distributed_muon_bitwise_equals_one_process(results, kind, impl):
    """Every rank's local parameters torch.equal to the one-process parameters' piece after 5 steps,
    AdamW parameters (some 0-element pieces at world 4) included; gathers only where the piece is not
    whole units."""
    world, ranks = results
    for rank, res in enumerate(ranks):
        case = res[kind, impl]
        bad = [n for n, (equal, _, _) in case.items() if not equal]
        assert not bad, (world, rank, kind, bad)
        gathers = {n: g for n, (_, g, _) in case.items() if n in EXPECTED_GATHERS[kind]}
        assert gathers == EXPECTED_GATHERS[kind], (world, rank, gathers)
        assert all(g == 0 for n, (_, g, _) in case.items() if n not in EXPECTED_GATHERS[kind])
    if world == 4:  # the cases the layouts are meant to cover did occur
        assert ranks[3]["owned", impl]["bias"][2] == (0,)  # an AdamW piece with 0 elements
        assert ranks[1]["owned", impl]["wq"][2] == (0, 8)  # a matrix owned by another rank
        assert ranks[3]["block_shard", impl]["wk"][2] == (0, 8)  # a block_shard rank holding no rows
        assert ranks[1]["block_shard", impl]["w1"][2] == (0, 8)  # w1 whole on rank 0


# ---------------------------------------------------------------- single process: routes and config


def _flex(placement, shape, dim=0, length=0, block=None, owner=None):
    return FakeFlex(placement, shape, dim, 0, length, block=block, owner=owner, world=2, rank=0)


def test_flex_route():
    assert flex_route(_flex("owned", (8, 4), length=8, owner=0), 2, None) == "local"
    assert flex_route(_flex("owned", (8, 4), owner=1), 2, None) == "skip"
    assert flex_route(_flex("block_shard", (8, 4), length=4, block=4), 2, 2) == "local"
    assert flex_route(_flex("block_shard", (8, 4), length=4, block=4), 2, None) == "gather"
    assert flex_route(_flex("block_shard", (8, 4), length=8, block=8), 2, None) == "gather"  # whole here, not there
    assert flex_route(_flex("block_shard", (8, 4), length=4, block=6), 2, 4) == "gather"  # heads cut
    assert flex_route(_flex("block_shard", (4, 8, 4), length=2, block=1), 3, None) == "local"  # whole matrices
    assert flex_route(_flex("block_shard", (4, 8, 4), dim=1, length=4, block=4), 3, None) == "gather"
    assert flex_route(_flex("shard", (8, 4), length=4), 2, 4) == "gather"  # the baseline, always


def test_per_head_groups_and_errors():
    model = build_model(model_config("llama3", "debug"), seed=0)
    hd = model.config.resolved_head_dim
    opt = OptimizerConfig(name="muon", muon_per_head=["layers.*.attention.wq.weight"]).build(model)
    per_head = [g for g in opt.param_groups if g["head_dim"]]
    assert len(per_head) == 1 and per_head[0]["head_dim"] == hd
    assert {id(p) for p in per_head[0]["params"]} == {id(layer.attention.wq.weight) for layer in model.layers.values()}
    whole = [p for g in opt.param_groups if g["use_muon"] and not g["head_dim"] for p in g["params"]]
    assert not {id(p) for p in whole} & {id(p) for p in per_head[0]["params"]}
    with pytest.raises(ConfigError, match="^optimizer.muon_per_head: 'nothing.*' matches no"):
        OptimizerConfig(name="muon", muon_per_head=["nothing.*"]).build(model)
    with pytest.raises(ConfigError, match="^optimizer.muon_per_head: 'tok_embeddings.weight' is not a Muon"):
        OptimizerConfig(name="muon", muon_per_head=["tok_*"]).build(model)
    toy = Toy()
    toy.w1 = nn.Parameter(torch.randn(10, 8))  # 10 rows: not whole heads of 4
    with pytest.raises(ConfigError, match="^optimizer.muon_per_head: 'w1' has 10 rows"):
        OptimizerConfig(name="muon", muon_per_head=["w1"]).build(toy)
    with pytest.raises(ConfigError, match="^optimizer.muon_per_head: needs a model"):
        OptimizerConfig(name="muon", muon_per_head=["0.weight"]).build(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ConfigError, match="^optimizer.muon_per_head: only applies"):
        OptimizerConfig(muon_per_head=["x"]).validate()


def test_per_head_update_scale_uses_the_head_block():
    """One step from zero momentum: every head's block gets its own ~orthogonal update scaled by
    0.2 * sqrt(max(head_dim, in)) (a whole-matrix step would use sqrt(max(rows, in)) and mix heads)."""
    p = nn.Parameter(torch.zeros(16, 8))
    p.grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    opt = Muon([{"params": [p], "use_muon": True, "weight_decay": 0.0, "head_dim": 4}], lr=1.0, betas=(0.9, 0.95),
               eps=1e-8, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype=torch.float32)
    opt.step()
    for head in p.detach().view(4, 4, 8):
        s = torch.linalg.svdvals(head / (0.2 * math.sqrt(8)))
        # NS-5's singular values land in about [0.68, 1.13] (see test_muon.py)
        assert s.min() > 0.6 and s.max() < 1.2, s


def test_fused_adamw_part_takes_empty_pieces():
    """A rank whose AdamW pieces are all 0-element (FlexShard's empty ranks) steps without error."""
    toy = Toy()
    for name, p in list(toy.named_parameters()):
        empty = nn.Parameter(p.detach()[:0].clone())
        empty.grad = torch.zeros_like(empty)
        module, attr = (toy.emb, "weight") if name == "emb.weight" else (toy, name)
        setattr(module, attr, empty)
    opt = OptimizerConfig(name="muon").build(toy)
    opt.step()
    assert all(p.numel() == 0 for p in toy.parameters())
