"""The paged decode attention op alone at SmolLM2-135M's shapes, against a previous build and SDPA.

Usage:
    .venv/bin/python benchmarks/paged_attention_kernel.py [--baseline REV] [--rounds 5] [--threads 0]
    .venv/bin/python benchmarks/paged_attention_kernel.py --engine [--dtype bfloat16]   # whole decode steps
    LOCKSTEP_CPU_ISA=portable .venv/bin/python benchmarks/paged_attention_kernel.py   # the C fallback

Batch 16, 9 query / 3 kv heads of 64, 16-token blocks, contexts 32/64/128/256, fp32 and bf16; 30
layers' worth of distinct pools per sweep (as a decode step reads them). Per call, process CPU time
(all OpenMP threads; the host is shared, so CPU time is steadier than wall time) and wall time, best
of ``--rounds`` interleaved rounds, and the K/V bytes a call reads over that CPU time. Block tables:
``--placement consecutive`` gives each sequence consecutive blocks (what the engine's allocator hands
out to sequences admitted together), ``scattered`` a random permutation of the pool. Pool layouts
(the same values, logically ``[blocks, block_size, Hkv, D]``): ``token`` (token-major, contiguous in
that order: the cache's layout before head-major pools), ``head`` (``[Hkv, blocks, block_size, D]``
storage: the cache's layout), ``block-head`` (``[blocks, Hkv, block_size, D]``). Sides:

- ``op``: ``torch.ops.lockstep.paged_decode_attention`` (the Python wrapper and the kernel), head layout;
- ``kernel:LAYOUT``: the same library called straight through ctypes with tables/positions prepared
  once (so ``op`` minus ``kernel:head`` is the per-call wrapper cost);
- ``base``: the kernel built from ``lockstep/ops/csrc/paged_attention.c`` at git revision
  ``--baseline`` (default ``HEAD``), called the same way as ``kernel``, on the token layout (a
  revision before strided pools reads only that one);
- ``sdpa``: one ``F.scaled_dot_product_attention`` over already gathered contiguous K/V
  (``enable_gqa``), a reference point that pays neither the gather nor the table walk.

``--engine``: lockstep's ``Engine`` on SmolLM2-135M (``compile_decode="inductor"``), batch 16,
32-token prompts, 64 new tokens, the kernel swapped between ``kernel`` and ``base`` between
interleaved rounds in one process (the compiled step calls the op's Python, which looks the library
up per call, so both run the same compiled graph): process CPU seconds a round, and the kernel calls'
thread CPU seconds. A baseline from before strided pools runs on token-major copies of the pools
(swapped in for its rounds: one more compiled variant), so ``base`` is then the old layout and kernel.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lockstep.ops import isa, paged_attention
from lockstep.ops.cbuild import build_library

BATCH, HEADS, KV_HEADS, D, BLOCK, LAYERS = 16, 9, 3, 64, 16, 30
CONTEXTS = (32, 64, 128, 256)
#: storage order of each pool layout, as a permutation of the logical [blocks, block_size, Hkv, D]
LAYOUTS = {"token": (0, 1, 2, 3), "head": (2, 0, 1, 3), "block-head": (0, 2, 1, 3)}


def baseline_library(rev: str) -> ctypes.CDLL | None:
    source = subprocess.run(["git", "show", f"{rev}:lockstep/ops/csrc/paged_attention.c"], capture_output=True,
                            text=True, check=True, cwd=Path(__file__).parent).stdout
    path = Path(tempfile.mkdtemp()) / "paged_attention_base.c"
    path.write_text(source)
    strided = "block_stride" in source  # the kernel takes the pools' strides (from the head-major pools on)
    level = "avx512" if isa.at_least("avx512") else "portable"
    lib = build_library(f"paged_attention_base_{level}", [path], paged_attention._FLAGS + isa.march_flags(level),
                        "the baseline paged attention kernel")
    if lib is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.paged_decode_attention.argtypes = [ptr] * 6 + [i64] * (9 if strided else 6) + [
            ctypes.c_float, ctypes.c_int, ptr, i64]
        lib.strided = strided
    return lib


def pool_in(layout: str, pool: torch.Tensor) -> torch.Tensor:
    """``pool [blocks, block_size, Hkv, D]`` stored in ``layout``'s order, viewed back in the logical order."""
    order = LAYOUTS[layout]
    return pool.permute(order).contiguous().permute([order.index(i) for i in range(4)])


def case(context: int, dtype: torch.dtype, gen: torch.Generator, layers_count: int, placement: str) -> list[dict]:
    width = (context + BLOCK - 1) // BLOCK
    blocks = BATCH * width + 1
    layers = []
    for _ in range(layers_count):
        k_pool = torch.randn(blocks, BLOCK, KV_HEADS, D, generator=gen).to(dtype)
        v_pool = torch.randn(blocks, BLOCK, KV_HEADS, D, generator=gen).to(dtype)
        ids = torch.randperm(blocks - 1, generator=gen) if placement == "scattered" else torch.arange(blocks - 1)
        tables = (ids[: BATCH * width].view(BATCH, width) + 1).contiguous()
        k = k_pool[tables.reshape(-1)].view(BATCH, width * BLOCK, KV_HEADS, D)[:, :context].transpose(1, 2)
        v = v_pool[tables.reshape(-1)].view(BATCH, width * BLOCK, KV_HEADS, D)[:, :context].transpose(1, 2)
        layers.append(dict(tables=tables, k=k.contiguous(), v=v.contiguous(),
                           **{layout: (pool_in(layout, k_pool), pool_in(layout, v_pool)) for layout in LAYOUTS}))
    return layers


class _TimedLibrary:
    """Stands in for the kernel's library inside the engine: calls ``library`` (a baseline without
    strides gets the call without them) and adds its thread CPU time to ``spent``."""

    def __init__(self, library: ctypes.CDLL, strided: bool) -> None:
        self.library, self.strided, self.spent = library, strided, 0.0

    def paged_decode_attention(self, *args) -> None:
        if not self.strided:
            args = args[:12] + args[15:]  # the pools are token-major then: no strides to pass
        start = time.thread_time()
        self.library.paged_decode_attention(*args)
        self.spent += time.thread_time() - start


def engine_rounds(base: ctypes.CDLL, dtype: str, rounds: int) -> None:
    from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
    from lockstep.models.hf import load_hf
    from lockstep.models.hf.gguf import smollm2_hf_dir

    model = load_hf(smollm2_hf_dir(), dtype=torch.float32).eval()
    engine = Engine(model, None, EngineConfig(cache_memory_mb=512, max_batch_size=BATCH, compile_decode="inductor",
                                              weights_dtype="model" if dtype == "float32" else dtype))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (BATCH, 32), generator=gen).tolist()
    sampling = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    built, level = paged_attention._built, "avx512" if isa.at_least("avx512") else "portable"
    layers = engine.cache._layers.values()
    head_major = [lc.pools for lc in layers]
    # a baseline without strides reads token-major pools: contiguous copies, swapped in for its rounds
    base_pools = head_major if base.strided else [tuple(p.contiguous() for p in lc.pools) for lc in layers]
    sides = {"kernel": (_TimedLibrary(built(level), True), head_major),
             "base": (_TimedLibrary(base, base.strided), base_pools)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    kernel_times: dict[str, list[float]] = {name: [] for name in sides}
    outputs = {}
    for round_ in range(rounds + 1):  # round 0 compiles
        for name, (timed, pools) in sides.items():
            paged_attention._built = lambda _level, timed=timed: timed
            for lc, own in zip(layers, pools):
                lc.pools = own
            timed.spent, cpu = 0.0, time.process_time()
            results = engine.generate([Request(prompt_ids=p, sampling=sampling) for p in prompts])
            if round_:
                times[name].append(time.process_time() - cpu)
                kernel_times[name].append(timed.spent)
            outputs[name] = [(r.token_ids, r.logprobs) for r in results]
    paged_attention._built = built
    for lc, own in zip(layers, head_major):
        lc.pools = own
    same = sum(a == b for a, b in zip(outputs["kernel"], outputs["base"]))

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    for label, table in (("generate", times), ("kernel calls", kernel_times)):
        line = ", ".join(f"{name} {median(t):.3f} ({min(t):.3f}-{max(t):.3f})" for name, t in table.items())
        print(f"engine, SmolLM2 {dtype}, batch {BATCH}, 32 + 64 tokens, {label}, CPU s, median of {rounds}: {line}; "
              f"base/kernel {median(table['base']) / median(table['kernel']):.3f}x")
    print(f"same greedy tokens and log-probabilities: {same}/{BATCH} sequences")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision of the kernel source to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=4, help="sweeps of 30 layers per timing")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="distinct pools a sweep reads (1: all in cache)")
    parser.add_argument("--engine", action="store_true", help="whole decode steps instead of the op alone")
    parser.add_argument("--dtype", default="bfloat16", help="--engine: the engine's weights dtype")
    parser.add_argument("--placement", choices=("consecutive", "scattered"), default="consecutive",
                        help="each sequence's blocks: consecutive in the pool (as the engine allocates) or random")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib, base = paged_attention._library(), baseline_library(args.baseline)
    if args.engine:
        if base is None:
            parser.error("--engine needs the baseline kernel built")
        engine_rounds(base, args.dtype, args.rounds)
        return
    gen = torch.Generator().manual_seed(0)
    scale = D**-0.5
    print(f"ISA level {isa.level()}, {torch.get_num_threads()} threads, baseline {args.baseline}, "
          f"{args.layers} layers' pools, {args.placement} blocks")
    print(f"batch {BATCH}, {HEADS}/{KV_HEADS} heads of {D}, blocks of {BLOCK}; us a call (process CPU / wall), "
          f"best of {args.rounds}; GB/s = K/V bytes read / CPU time")
    for dtype in (torch.float32, torch.bfloat16):
        for context in CONTEXTS:
            layers = case(context, dtype, gen, args.layers, args.placement)
            q = torch.randn(BATCH, HEADS, 1, D, generator=gen).to(dtype)
            positions = torch.full((BATCH, 1), context - 1, dtype=torch.int64)
            out = torch.empty_like(q)
            bf16 = int(dtype == torch.bfloat16)

            def raw(library, layer, layout, strided=True):
                k_pool, v_pool = layer[layout]
                strides = k_pool.stride()[:3] if strided else ()
                library.paged_decode_attention(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                                               layer["tables"].data_ptr(), positions.data_ptr(), out.data_ptr(),
                                               BATCH, HEADS, KV_HEADS, D, BLOCK, layer["tables"].shape[1], *strides,
                                               scale, bf16, None, 0)

            sides = {
                "op": lambda layer: torch.ops.lockstep.paged_decode_attention(
                    q, *layer["head"], layer["tables"], positions, scale),
                **{f"kernel:{layout}": lambda layer, layout=layout: raw(lib, layer, layout) for layout in LAYOUTS},
                "sdpa": lambda layer: F.scaled_dot_product_attention(q, layer["k"], layer["v"], scale=scale,
                                                                     enable_gqa=True),
            }
            if base is not None:
                sides["base"] = lambda layer: raw(base, layer, "token", base.strided)
            results = {name: ([], []) for name in sides}
            for name, fn in sides.items():  # warm-up
                for layer in layers:
                    fn(layer)
            for _ in range(args.rounds):
                for name, fn in sides.items():
                    cpu, wall = time.process_time(), time.perf_counter()
                    for _ in range(args.reps * LAYERS // len(layers)):
                        for layer in layers:
                            fn(layer)
                    calls = args.reps * LAYERS // len(layers) * len(layers)
                    results[name][0].append((time.process_time() - cpu) / calls)
                    results[name][1].append((time.perf_counter() - wall) / calls)
            kv_bytes = 2 * BATCH * context * KV_HEADS * D * q.element_size()
            line = "  ".join(f"{name} {min(c) * 1e6:6.1f}/{min(w) * 1e6:6.1f} ({kv_bytes / min(c) / 1e9:4.1f} GB/s)"
                             for name, (c, w) in results.items())
            ratio = (f"  base/kernel:head {min(results['base'][0]) / min(results['kernel:head'][0]):.2f}x"
                     if base else "")
            print(f"{str(dtype)[6:]:>8} ctx {context:3d}: {line}{ratio}")


if __name__ == "__main__":
    main()
