"""FlexShard (lockstep.parallel.flex) against FSDP2, multi-process (gloo, one spawn per world size).

Each case trains 5 AdamW steps (the global gradient norm computed, not clipped: see ``MAX_NORM``) from
the same seeded weights and batches, through ``parallelize_dense`` with ``parallel.sharding`` fsdp2 or flex.
Claimed (the issue's bound): losses within 1e-6 absolute of FSDP2's per step. Measured: equal where
each gradient element is reduced in FSDP2's order (shard(0) at any world; any placement at world 2
and under HSDP 2x2: sums of two terms), so those parameters are compared with ``torch.equal``; owned
and block_shard pieces at world 4 see another summation order (``PARAM_TOL``), their losses within
1 ulp (9.5e-7 at ~8.3).

Also: the FP8 bucket's gathered weights equal gather-then-quantise bit for bit and its all-gather
sends <= 0.55x of BF16's (bytes measured by wrapping torch.distributed's all-gather); resharding
after forward gathers again in backward ("always") or not ("never"); checkpoints move between flex
(owned + block_shard, empty pieces included) and FSDP2 and between world sizes 2 and 4.
"""

from __future__ import annotations

import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]

STEPS, BATCH, SEQ = 5, 4, 16
# no clipping in the parity runs: the global norm is the same sum in another order (FSDP2: one norm per
# DTensor parameter, reduced; flex: local squares summed, one all-reduce), so a clipped step differs from
# FSDP2's in the last bits (measured: 3e-7 on parameters after 5 steps at max_norm 1). The norms
# themselves are compared (relative 1e-6).
MAX_NORM = float("inf")
# every glob must match something in each family: "[!l]*" = the root's parameters (embedding, norm, head)
REST = "[!l]*|layers.*_norm.*|layers.*.attention.wo.*"
MIXED = ["layers.*.attention.w[qkv].weight=block_shard(0,16)", "layers.*.feed_forward.*=owned", REST + "=shard(0)"]
FP8 = ["layers.*.feed_forward.w[13].weight=block_shard(0,16)+fp8",
       "layers.*.feed_forward.w2.weight|layers.*.attention.w*|" + REST + "=shard(0)"]
NO_FP8 = [FP8[0].replace("+fp8", ""), FP8[1]]
# (case, family, ParallelConfig fields, activation checkpointing); "<family> fsdp2" is each one's reference
WORLD2 = [
    ("llama3 fsdp2", "llama3", {}, "none"),
    ("llama3 shard", "llama3", {"sharding": "flex"}, "none"),
    ("llama3 mixed ac", "llama3", {"sharding": "flex", "flex_buckets": MIXED}, "full"),
    ("llama3 muon never", "llama3", {"sharding": "flex", "flex_preset": "muon", "reshard_after_forward": "never"},
     "none"),
    ("qwen3_moe fsdp2", "qwen3_moe", {}, "none"),
    ("qwen3_moe shard", "qwen3_moe", {"sharding": "flex"}, "none"),
    ("qwen3_moe mixed", "qwen3_moe", {"sharding": "flex", "flex_buckets": MIXED}, "none"),
    # BF16 gathers under bf16 autocast (FSDP2's param_dtype), fp32 reduce
    ("qwen3_moe bf16 fsdp2", "qwen3_moe", {"fsdp_param_dtype": "bfloat16"}, "none"),
    ("qwen3_moe bf16 mixed", "qwen3_moe", {"fsdp_param_dtype": "bfloat16", "sharding": "flex", "flex_buckets": MIXED},
     "none"),
]
WORLD4 = [
    ("llama3 fsdp2", "llama3", {}, "none"),
    ("llama3 shard", "llama3", {"sharding": "flex"}, "none"),
    ("llama3 mixed", "llama3", {"sharding": "flex", "flex_buckets": MIXED}, "none"),
    ("qwen3_moe fsdp2", "qwen3_moe", {}, "none"),
    ("qwen3_moe shard", "qwen3_moe", {"sharding": "flex"}, "none"),
    ("qwen3_moe mixed except_last", "qwen3_moe",
     {"sharding": "flex", "flex_buckets": MIXED, "reshard_after_forward": "except_last"}, "none"),
    ("llama3 hsdp fsdp2", "llama3", {"dp_replicate": 2, "dp_shard": 2}, "none"),
    ("llama3 hsdp mixed", "llama3", {"dp_replicate": 2, "dp_shard": 2, "sharding": "flex", "flex_buckets": MIXED},
     "none"),
    # the feed-forward owned over all 4 data-parallel ranks (@dp), the rest over dp_shard + replicas
    ("llama3 hsdp mixed dp", "llama3", {"dp_replicate": 2, "dp_shard": 2, "sharding": "flex",
                                        "flex_buckets": [MIXED[0], MIXED[1] + "@dp", MIXED[2]]}, "none"),
]


class _Gathers:
    """Wraps torch.distributed's all-gather functions; counts calls and the bytes each rank passes."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __enter__(self):
        self.sent, self.calls, self._saved = 0, 0, {}
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapped(out, inp, *args, _fn=fn, **kwargs):
                self.sent += inp.numel() * inp.element_size()
                self.calls += 1
                return _fn(out, inp, *args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def _build(family: str, fields: dict, ac: str, seed: int = 0):
    from lockstep.models.common.transformer import build_model
    from lockstep.models.registry import model_config
    from lockstep.parallel.dims import ParallelConfig
    from lockstep.parallel.runtime import ParallelRuntime
    from lockstep.train.optim import AdamWConfig

    config = ParallelConfig(**{"dp_shard": -1, **fields})
    config.validate()
    dtype = torch.bfloat16 if config.fsdp_param_dtype == "bfloat16" else torch.float32
    runtime = ParallelRuntime.create(config, device="cpu", dtype=dtype)
    model = runtime.parallelize(build_model(model_config(family, "debug"), seed=seed), config, ac)
    return runtime, model, AdamWConfig(lr=1e-2).build(model)


def _full(runtime, model) -> dict[str, torch.Tensor]:
    state = runtime.full_state_dict(model)  # collective; whole tensors on the first rank
    return state


def _train(family: str, fields: dict, ac: str) -> dict:
    from lockstep.run.objective import LMObjective

    runtime, model, optimizer = _build(family, fields, ac)
    world = runtime.world_size
    losses, backward_gathers, norms = [], [], []
    for x, y in _batches(model.config.vocab_size):
        dp = runtime.dims.dp
        batch = (x.chunk(dp)[runtime.dp_rank], y.chunk(dp)[runtime.dp_rank])
        with runtime.autocast():
            loss, _ = LMObjective()(model, batch)
        with _Gathers() as gathers:
            loss.backward()
        backward_gathers.append(gathers.calls)
        norms.append(runtime.clip_gradients(MAX_NORM).item())
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        runtime.apply_step(optimizer)
    return {"losses": losses, "params": _full(runtime, model), "backward_gathers": backward_gathers, "norms": norms,
            "runtime": runtime, "model": model, "optimizer": optimizer,
            "describe": runtime.describe()["sharding"], "parity": _parity(runtime, family, fields)}


def _parity(runtime, family: str, fields: dict) -> str | None:
    from lockstep.parallel.dims import ParallelConfig

    return runtime.describe(family, ParallelConfig(**{"dp_shard": -1, **fields}))["parity_test"]


def _optimizer_full(model, optimizer) -> dict[str, torch.Tensor]:
    """exp_avg of every parameter, whole (a collective)."""
    from torch.distributed.tensor import DTensor

    from lockstep.checkpoint.train_state import param_fqns

    fqns = param_fqns(model)
    out = {}
    for p in model.parameters():
        value = optimizer.state[p]["exp_avg"]
        if hasattr(p, "_flex"):
            value = p._flex.gather_full(value)
        elif isinstance(value, DTensor):
            value = value.full_tensor()
        out[fqns[id(p)]] = value.clone()
    return out


def _save(path: str, trained: dict, rank: int, world: int) -> None:
    from lockstep.checkpoint.checkpointer import Checkpointer
    from lockstep.checkpoint.storage import LocalStorage
    from lockstep.checkpoint.train_state import model_slots, optimizer_slots

    ck = Checkpointer(LocalStorage(path), rank=rank, world_size=world, mode="sync")
    model, optimizer = trained["model"], trained["optimizer"]
    ck.save(STEPS, {**model_slots(model), **optimizer_slots(model, optimizer)}, {})
    ck.close()


def _load(path: str, family: str, fields: dict, rank: int, world: int) -> dict:
    """A fresh model (other seed) and optimizer of ``fields`` loaded from ``path``: whole params and exp_avg."""
    from lockstep.checkpoint.checkpointer import Checkpointer
    from lockstep.checkpoint.storage import LocalStorage
    from lockstep.checkpoint.train_state import ensure_optimizer_state, model_slots, optimizer_slots

    runtime, model, optimizer = _build(family, fields, "none", seed=7)
    ensure_optimizer_state(optimizer)
    ck = Checkpointer(LocalStorage(path), rank=rank, world_size=world, mode="sync")
    step, _, _ = ck.load({**model_slots(model), **optimizer_slots(model, optimizer)})
    ck.close()
    return {"step": step, "params": _full(runtime, model), "exp_avg": _optimizer_full(model, optimizer)}


def _fp8_case(rank: int) -> dict:
    """The FP8 bucket's gather (one collective) vs quantising the gathered weights; bytes vs BF16."""
    from lockstep.parallel.fp8_gather import dequantize_blockwise, quantize_blockwise

    out = {}
    for name, buckets in (("fp8", FP8), ("bf16", NO_FP8)):
        runtime, model, _ = _build("llama3", {"sharding": "flex", "flex_buckets": buckets,
                                              "fsdp_param_dtype": "bfloat16"}, "none")
        flex = model._flex_shard
        group = next(g for g in flex.units[1].groups if "w1" in g.layouts[0].fqn)
        with _Gathers() as gathers:
            group.start_gather()
            wholes = group.wait_wholes()
        out[name] = (gathers.sent, gathers.calls)
        if name == "fp8":
            equal = []
            for p, whole in zip(group.params, wholes):
                full = p._flex.gather_full(p.detach().to(torch.bfloat16))  # gather in BF16, then quantise
                q, s = quantize_blockwise(full, 16)
                equal.append(torch.equal(whole, dequantize_blockwise(q, s, 16, torch.bfloat16)))
            out["equal"] = equal
            out["fqns"] = [lay.fqn for lay in group.layouts]
            out["master_dtype"] = {str(p.dtype) for p in group.params}
            # training through the FP8 bucket: gradients reach the master weights
            from lockstep.run.objective import LMObjective

            x, y = _batches(model.config.vocab_size)[0]
            loss, _ = LMObjective()(model, (x.chunk(2)[rank], y.chunk(2)[rank]))
            loss.backward()
            out["grads"] = [p.grad is not None and p.grad.shape == p.shape and bool(p.grad.abs().sum() > 0)
                            for p in group.params]
    return out


def _gather_order(model) -> list[tuple[str, str]]:
    """(issue | wait, unit) of every group gather in one forward, in order (instance-level wrappers)."""
    events = []
    for unit in model._flex_shard.units:
        for g in unit.groups:
            def start(_g=g, _orig=g.start_gather, _name=unit.name):
                if _g.pending is None:
                    events.append(("issue", _name))
                _orig()

            def wait(_orig=g.wait_wholes, _name=unit.name):
                events.append(("wait", _name))
                return _orig()

            g.start_gather, g.wait_wholes = start, wait
    x, y = _batches(model.config.vocab_size)[0]
    with torch.no_grad():
        model(x[:1])
    return events


def _misc(model) -> dict:
    """A flex state dict pickles (``torch.save``; the process group is left out); AC regions are refused."""
    import io

    from lockstep.config.base import ConfigError
    from lockstep.parallel.checkpointing import ActivationCheckpointConfig

    out = {}
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    out["pickled"] = buffer.tell() > 0
    try:
        _build("llama3", {"sharding": "flex"}, ActivationCheckpointConfig(mode="regions"))
    except ConfigError as err:
        out["regions"] = str(err)
    return out


def _worker(rank: int, world: int, init_file: str, out_dir: str, cases: list, load_from: str) -> None:
    torch.set_num_threads(1)
    os.environ["WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    results: dict = {"cases": {}}
    trained = {}
    for name, family, fields, ac in cases:
        res = _train(family, fields, ac)
        trained[name] = res
        results["cases"][name] = {k: res[k] for k in ("losses", "params", "backward_gathers", "norms", "describe", "parity")}
    mixed = next(n for n, *_ in cases if n.startswith("llama3 mixed"))
    mixed_fields = next(f for n, _, f, _ in cases if n == mixed)
    results["mixed_case"] = mixed
    results["mixed_exp_avg"] = _optimizer_full(trained[mixed]["model"], trained[mixed]["optimizer"])
    results["fsdp2_exp_avg"] = _optimizer_full(trained["llama3 fsdp2"]["model"], trained["llama3 fsdp2"]["optimizer"])
    flex_dir, fsdp_dir = os.path.join(out_dir, "ckpt-flex"), os.path.join(out_dir, "ckpt-fsdp2")
    _save(flex_dir, trained[mixed], rank, world)
    _save(fsdp_dir, trained["llama3 fsdp2"], rank, world)
    results["flex->fsdp2"] = _load(flex_dir, "llama3", {}, rank, world)
    results["fsdp2->flex"] = _load(fsdp_dir, "llama3", mixed_fields, rank, world)
    if load_from:  # the other world size's flex checkpoint, into flex (the muon preset: other placements)
        results["other-world flex->flex"] = _load(load_from, "llama3", {"sharding": "flex", "flex_preset": "muon"},
                                                  rank, world)
    if world == 2:
        results["fp8"] = _fp8_case(rank)
        results["gather_order"] = _gather_order(trained["llama3 shard"]["model"])
        results["misc"] = _misc(trained["llama3 shard"]["model"])
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _spawn(computed_once, world: int, cases: list, load_from: str = "") -> tuple[dict, str]:
    tmp = computed_once(f"flex_shard world {world}", lambda d: mp.spawn(
        _worker, args=(world, str(d / "init"), str(d), cases, load_from), nprocs=world, join=True))
    return torch.load(tmp / "results.pt", weights_only=False), str(tmp)


@pytest.fixture(scope="module")
def world2(computed_once):
    return _spawn(computed_once, 2, WORLD2)


@pytest.fixture(scope="module")
def world4(computed_once, world2):
    _, world2_dir = world2
    return _spawn(computed_once, 4, WORLD4, load_from=os.path.join(world2_dir, "ckpt-flex"))


# Parameters are torch.equal to FSDP2's except where a gradient element sums more than two ranks' terms in
# another order: an owned / block_shard piece sits in another rank's slot of gloo's reduce-scatter than
# FSDP2's row shard, and fp32 addition of 4 terms depends on the order (2 terms do not). AdamW's
# normalised step turns that last-bit gradient noise into parameter differences, largest on rarely seen
# embedding / head rows (measured: 2.1e-5 llama3, 2.4e-6 qwen3_moe, after 5 steps at lr 1e-2; a missing
# or doubled reduction moves them by ~lr = 1e-2).
PARAM_TOL = {"llama3 mixed": 1e-4, "qwen3_moe mixed except_last": 1e-4, "llama3 hsdp mixed dp": 1e-4}


def _check_against_fsdp2(res: dict, name: str, world: int) -> None:
    cases = res["cases"]
    family = name.split()[0] + "".join(f" {tag}" for tag in ("hsdp", "bf16") if tag in name.split())
    ref, got = cases[f"{family} fsdp2"], cases[name]
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    diffs = [abs(a - b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(diffs) <= 1e-6, (name, got["losses"], ref["losses"])
    assert got["params"].keys() == ref["params"].keys()
    tol = PARAM_TOL.get(name, 0.0) if world == 4 else 0.0
    bad = [k for k, v in ref["params"].items()
           if not (torch.equal(v, got["params"][k]) or (tol and torch.allclose(v, got["params"][k], rtol=0, atol=tol)))]
    assert not bad, (name, bad[:5])
    assert got["describe"]["sharding"] == "flex" and ref["describe"] == "fsdp2"
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(got["norms"], ref["norms"])), (got["norms"], ref["norms"])


@pytest.mark.parametrize("name", [c[0] for c in WORLD2 if "fsdp2" not in c[0]])
def test_flex_matches_fsdp2_world2(world2, name):
    _check_against_fsdp2(world2[0], name, 2)


@pytest.mark.parametrize("name", [c[0] for c in WORLD4 if "fsdp2" not in c[0]])
def test_flex_matches_fsdp2_world4(world4, name):
    _check_against_fsdp2(world4[0], name, 4)


def test_next_unit_is_gathered_before_waiting_on_this_one(world2):
    """Prefetch: each unit's pre-hook issues the next unit's gather, then waits for its own."""
    assert world2[0]["gather_order"] == [
        ("issue", "root"), ("issue", "layers.0"), ("wait", "root"),
        ("issue", "layers.1"), ("wait", "layers.0"), ("wait", "layers.1")]


def test_state_dict_pickles_and_regions_are_refused(world2):
    misc = world2[0]["misc"]
    assert misc["pickled"]
    assert misc["regions"].startswith("parallel.sharding: flex supports training.activation_checkpoint modes")


def test_manifest_records_buckets(world2):
    record = world2[0]["cases"]["qwen3_moe mixed"]["describe"]
    assert [b["placement"] for b in record["buckets"]] == ["block_shard(0,16)", "owned", "shard(0)"]
    assert [b["params"] for b in record["buckets"]][:2] == [6, 2 * 4]  # q/k/v x 2 layers; router + 3 experts x 2
    assert all(b["bytes_per_rank"] > 0 for b in record["buckets"])
    # the manifest's parity test names both proofs: the FSDP2 layout's and flex == FSDP2
    parity = world2[0]["cases"]["qwen3_moe mixed"]["parity"]
    assert "test_layout_matches_one_process[dp_shard=2 moe]" in parity
    assert "test_flex_shard.py::test_flex_matches_fsdp2_world2" in parity


def test_reshard_after_forward_regathers_in_backward(world2, world4):
    """"always": every step's backward gathers again (the saved whole tensors were dropped); "never":
    no gather in backward; activation checkpointing's recompute gathers its blocks again."""
    cases = world2[0]["cases"]
    assert cases["llama3 shard"]["backward_gathers"] == [3] * STEPS  # one per unit: 2 blocks + root
    assert all(n == 0 for n in cases["llama3 muon never"]["backward_gathers"])
    assert all(n >= 2 for n in cases["llama3 mixed ac"]["backward_gathers"])
    # except_last: the last block keeps its tensors; the root and block 0 gather again (the groups
    # per unit do not depend on the world size: world 2's "always" run has the same ones)
    except_last = world4[0]["cases"]["qwen3_moe mixed except_last"]["backward_gathers"]
    always = cases["qwen3_moe mixed"]["backward_gathers"]
    assert all(0 < a < b for a, b in zip(except_last, always)), (except_last, always)


@pytest.mark.parametrize("world", [2, 4])
def test_checkpoint_between_flex_and_fsdp2(world2, world4, world):
    """Save under flex (owned + block_shard; empty pieces at world 4) and load under FSDP2, and back:
    parameters and AdamW state torch.equal to the saved ones."""
    res = (world2 if world == 2 else world4)[0]
    mixed, fsdp = res["cases"][res["mixed_case"]], res["cases"]["llama3 fsdp2"]
    to_fsdp, to_flex = res["flex->fsdp2"], res["fsdp2->flex"]
    assert to_fsdp["step"] == to_flex["step"] == STEPS
    for name, saved, loaded, saved_m, loaded_m in (
            ("flex->fsdp2", mixed["params"], to_fsdp["params"], res["mixed_exp_avg"], to_fsdp["exp_avg"]),
            ("fsdp2->flex", fsdp["params"], to_flex["params"], res["fsdp2_exp_avg"], to_flex["exp_avg"])):
        assert saved.keys() == loaded.keys()
        assert not [k for k in saved if not torch.equal(saved[k], loaded[k])], name
        assert saved_m.keys() == loaded_m.keys()
        assert not [k for k in saved_m if not torch.equal(saved_m[k], loaded_m[k])], name


def test_checkpoint_across_world_sizes(world2, world4):
    """Flex (mixed buckets) at world 2 -> flex (muon preset: other placements) at world 4."""
    saved = world2[0]["cases"][world2[0]["mixed_case"]]["params"]
    loaded = world4[0]["other-world flex->flex"]
    assert loaded["step"] == STEPS
    assert not [k for k in saved if not torch.equal(saved[k], loaded["params"][k])]
    assert not [k for k in world2[0]["mixed_exp_avg"]
                if not torch.equal(world2[0]["mixed_exp_avg"][k], loaded["exp_avg"][k])]


def test_fp8_bucket_gathers_quantised_weights_at_half_the_bytes(world2):
    """The FP8 bucket's whole weights == quantise(gather in BF16) (torch.equal); its one all-gather
    sends <= 0.55x of the same bucket's BF16 gather (16x16 tiles: 1 byte + 4/256 per element vs 2)."""
    fp8 = world2[0]["fp8"]
    assert fp8["fqns"] == ["layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w3.weight"]
    assert fp8["equal"] == [True, True]
    assert fp8["master_dtype"] == {"torch.float32"}  # master weights stay full precision
    assert fp8["grads"] == [True, True]
    (fp8_bytes, fp8_calls), (bf16_bytes, bf16_calls) = fp8["fp8"], fp8["bf16"]
    assert fp8_calls == bf16_calls == 1
    assert bf16_bytes == 2 * (192 // 2) * 64 * 2  # w1 and w3: 96 rows x 64 columns per rank, 2 bytes
    assert fp8_bytes / bf16_bytes <= 0.55, fp8_bytes / bf16_bytes
