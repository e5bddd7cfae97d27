"""Blockwise-FP8 all-gather (lockstep.parallel.fp8_gather): quantiser, bitwise gather, bytes on the wire.

Single-process tests pin the quantiser (one scale per 128x128 tile, edge tiles, zero tiles, the error
bound, argument errors). One gloo spawn per world (2 and 4, one thread per rank) runs every gather
case and the tests read its results: quantise-then-gather == gather-then-quantise (``torch.equal`` on
the FP8 bytes viewed as uint8 and on the scales) for shapes that are and are not multiples of 128, the
bytes passed to the all-gather (measured by wrapping torch.distributed's all-gather functions) at most
0.55x of the BF16 gather's, and the error for a shard that is not whole tile-rows.
"""

import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lockstep.parallel.fp8_gather import (FP8_MAX, block_shard_rows, dequantize_blockwise, gather_block_rows,
                                          gather_blockwise_fp8, quantize_blockwise, shard_block_rows,
                                          wire_bytes_ratio)

SHAPES = [(256, 384), (300, 200), (130, 128), (512, 64)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BYTES_SHAPE = (1024, 256)


def _weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # columns spanning 5 decades so tiles have very different scales
    return (torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[1])).to(dtype)


def _u8(q):
    return q.view(torch.uint8)


# ---------------------------------------------------------------- single process: the quantiser


@pytest.mark.parametrize("shape", SHAPES + [(1, 1), (128, 129)])
def test_one_scale_per_tile_and_each_tile_quantised_alone(shape):
    """scale = amax / 448 of the tile's real elements; every tile's FP8 bytes and scale equal those of
    the tile quantised on its own (what makes the gather bitwise)."""
    w = _weight(shape, torch.float32)
    q, s = quantize_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert torch.equal(s[i, j], tile.abs().max() / FP8_MAX), (i, j)
            alone_q, alone_s = quantize_blockwise(tile.clone())
            assert torch.equal(alone_s[0, 0], s[i, j])
            assert torch.equal(_u8(alone_q), _u8(q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128])), (i, j)
            # the tile's largest magnitude lands on e4m3's largest value
            assert float(q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float().abs().max()) == FP8_MAX


def test_zero_tile_has_scale_one():
    w = torch.zeros(256, 130)
    w[:128, :128] = 3.0
    q, s = quantize_blockwise(w)
    assert torch.equal(s, torch.tensor([[3.0 / 448, 1.0], [1.0, 1.0]]))
    assert torch.equal(_u8(q[128:]), torch.zeros(128, 130, dtype=torch.uint8))
    assert torch.equal(dequantize_blockwise(q, s, dtype=torch.float32), w)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantise_error_bound(shape, dtype):
    """|dq - x| <= max(2^-4 |x|, 2^-10 scale): half of e4m3's step (3 mantissa bits, relative step 2^-3)
    for normal values, half the subnormal step 2^-9 (in units of the tile's scale) below 2^-6; times
    (1 + 2^-20) for the fp32 product's rounding. Returned in fp32 so no output cast adds to it."""
    w = _weight(shape, dtype)
    q, s = quantize_blockwise(w)
    dq = dequantize_blockwise(q, s, dtype=torch.float32)
    x = w.float()
    scale = s.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]
    bound = torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -10) * (1 + 2 ** -20)
    assert bool(((dq - x).abs() <= bound).all()), float(((dq - x).abs() / bound).max())
    # and the bf16 output is that value rounded once more
    assert torch.equal(dequantize_blockwise(q, s), dq.to(torch.bfloat16))


@pytest.mark.parametrize("block", [0, -128, 1.5, True, "128"])
def test_bad_block_is_a_value_error_naming_it(block):
    with pytest.raises(ValueError, match="block"):
        quantize_blockwise(torch.ones(4, 4), block)
    with pytest.raises(ValueError, match="block"):
        block_shard_rows(256, 2, 0, block)


def test_bad_tensors_are_value_errors_naming_them():
    with pytest.raises(ValueError, match="^w:"):
        quantize_blockwise(torch.ones(4))
    with pytest.raises(ValueError, match="^w:"):
        quantize_blockwise(torch.ones(4, 4, dtype=torch.int32))
    q, s = quantize_blockwise(torch.ones(130, 4))
    with pytest.raises(ValueError, match="^scales:"):
        dequantize_blockwise(q, s[:1])
    with pytest.raises(ValueError, match="^full_rows:"):
        block_shard_rows(0, 2, 0)


def test_block_shard_rows_are_whole_tile_rows():
    # 300 rows = 3 tile-rows; over 2 ranks: 2 tile-rows each (slot 256), the last rank's real rows 256..300
    assert [block_shard_rows(300, 2, r) for r in range(2)] == [(0, 256, 256, 2), (256, 300, 256, 2)]
    # 130 rows = 2 tile-rows over 4 ranks: ranks 2 and 3 hold nothing
    rows = [block_shard_rows(130, 4, r) for r in range(4)]
    assert [(r.start, r.stop) for r in rows] == [(0, 128), (128, 130), (130, 130), (130, 130)]
    assert {r.slot for r in rows} == {128}
    for full, world in [(300, 2), (130, 4), (1024, 4), (5, 3)]:
        parts = [block_shard_rows(full, world, r, 16) for r in range(world)]
        assert parts[0].start == 0 and parts[-1].stop == full
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
        assert all(p.start % 16 == 0 for p in parts if p.stop > p.start)  # empty shards start at full


# ---------------------------------------------------------------- multi-process: the gather


class _Bytes:
    """Wraps torch.distributed's all-gather functions; adds up the bytes of the tensor each rank passes."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "all_gather")

    def __enter__(self):
        self.sent, self.calls, self._saved = 0, 0, {}
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapped(*args, _fn=fn, _name=name, **kwargs):
                inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("tensor"))
                self.sent += inp.numel() * inp.element_size()
                self.calls += 1
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    res = {"equal": {}, "dequant": {}, "padded": {}, "gathered": {}}
    for shape in SHAPES:
        for dname, dtype in DTYPES.items():
            w = _weight(shape, dtype)
            local = shard_block_rows(torch.nn.Parameter(w))  # a parameter's storage, as FlexShard passes it
            q, s = gather_blockwise_fp8(local, full_rows=shape[0])
            full = gather_block_rows(local, full_rows=shape[0])  # gather-then-quantise
            ref_q, ref_s = quantize_blockwise(full)
            case = (shape, dname)
            res["gathered"][case] = torch.equal(full, w) and not q.requires_grad and not full.requires_grad
            res["equal"][case] = torch.equal(_u8(q), _u8(ref_q)) and torch.equal(s, ref_s)
            dq = gather_blockwise_fp8(local, full_rows=shape[0], dequantize=torch.bfloat16)
            res["dequant"][case] = torch.equal(dq, dequantize_blockwise(ref_q, ref_s))
            # the whole slot as input (padding rows ignored, even NaN)
            rows = block_shard_rows(shape[0], world, rank)
            slot = torch.full((rows.slot, shape[1]), float("nan"), dtype=dtype)
            slot[:local.shape[0]] = local
            pq, ps = gather_blockwise_fp8(slot, full_rows=shape[0])
            res["padded"][case] = torch.equal(_u8(pq), _u8(ref_q)) and torch.equal(ps, ref_s)
    w = _weight(BYTES_SHAPE, torch.float32)
    local = shard_block_rows(w)
    with _Bytes() as fp8:
        gather_blockwise_fp8(local, full_rows=BYTES_SHAPE[0])
    with _Bytes() as bf16:
        gather_block_rows(local.bfloat16(), full_rows=BYTES_SHAPE[0])
    res["bytes"] = {"fp8": (fp8.sent, fp8.calls), "bf16": (bf16.sent, bf16.calls)}
    # a shard that is not whole tile-rows
    try:
        gather_blockwise_fp8(w[:100], full_rows=BYTES_SHAPE[0])
    except ValueError as e:
        res["bad_shard"] = str(e)
    dist.destroy_process_group()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, computed_once):
    world = request.param
    tmp = computed_once(f"fp8-gather spawn world {world}", lambda d: mp.spawn(
        _worker, args=(world, str(d / "init"), str(d)), nprocs=world, join=True))
    return world, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]



@pytest.mark.slow
@pytest.mark.xdist_group("parallel")
def test_quantise_then_gather_equals_gather_then_quantise(results):
    """FP8 bytes (as uint8) and scales torch.equal, every rank, shapes multiple of 128 and not, bf16 and
    fp32 parameters; also from slot-padded input, and the dequantised result."""
    world, ranks = results
    for rank, res in enumerate(ranks):
        for key in ("gathered", "equal", "padded", "dequant"):
            assert len(res[key]) == len(SHAPES) * len(DTYPES)
            bad = [case for case, ok in res[key].items() if not ok]
            assert not bad, (world, rank, key, bad)


@pytest.mark.slow
@pytest.mark.xdist_group("parallel")
def test_fp8_gather_sends_at_most_055x_of_bf16(results):
    """Bytes passed to the all-gather per rank: one collective each; FP8 data + fp32 scales vs BF16 rows."""
    world, ranks = results
    for res in ranks:
        (fp8, fp8_calls), (bf16, bf16_calls) = res["bytes"]["fp8"], res["bytes"]["bf16"]
        assert fp8_calls == 1 and bf16_calls == 1
        slot = block_shard_rows(BYTES_SHAPE[0], world, 0).slot
        assert bf16 == slot * BYTES_SHAPE[1] * 2
        assert fp8 == slot * BYTES_SHAPE[1] + (slot // 128) * (BYTES_SHAPE[1] // 128) * 4
        assert fp8 / bf16 <= 0.55, fp8 / bf16
        assert fp8 / bf16 == wire_bytes_ratio(BYTES_SHAPE, world)


@pytest.mark.slow
@pytest.mark.xdist_group("parallel")
def test_shard_that_is_not_whole_tile_rows_is_a_value_error(results):
    _, ranks = results
    for res in ranks:
        assert res.get("bad_shard", "").startswith("local_rows:"), res.get("bad_shard")
        assert "got 100" in res["bad_shard"]
