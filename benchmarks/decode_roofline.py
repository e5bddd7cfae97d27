"""Batch-1 decode roofline: the tokens/s memory bandwidth allows SmolLM2-135M on one thread of this CPU.

At batch 1 a decode step reads every weight once (and the KV cache of every layer) and does 2 flops
per weight: the step is bound by memory bandwidth, not arithmetic. This script measures (all times
the calling thread's CPU time, best of ``--rounds``: the host may be loaded)

1. one thread's read bandwidth over 512 MiB (far beyond the caches): a C loop reading every word
   (``_stream_read.c``), torch's ``sum`` and ``copy_`` (read + write); the bound takes the fastest;
2. what lockstep's decode linears reach: :mod:`lockstep.ops.decode_linear` at 1 row over SmolLM2-135M's
   30 layers of linears and its head, packed (bf16 and fp32), as weight bytes per second;
3. the bytes one decode step reads (linear weights incl. the tied head, norms, the KV cache at the
   given context) per dtype, and so the upper bound ``bandwidth / bytes`` in tokens/s, next to the
   linears-only time of (2) as tokens/s.

    .venv/bin/python benchmarks/decode_roofline.py [--rounds 5] [--context 48]
    LOCKSTEP_CPU_ISA=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 .venv/bin/python benchmarks/decode_roofline.py

Compare the bounds with the engines' batch-1 tokens/s of ``benchmarks/generate_throughput.py`` (same
thread count; those include prefill and sampling, so they sit a little lower still).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path

import torch

from lockstep.ops import decode_linear, isa
from lockstep.ops.cbuild import build_library

from decode_kernels import best_of as best_of_clock  # this directory (benchmarks/) is on sys.path

# SmolLM2-135M: dim 576, 30 layers, 9 query / 3 kv heads of 64, hidden 1536, vocab 49152 (head tied)
DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 576, 30, 9, 3, 64, 1536, 49152
#: (name, out_features, in_features, count): q/k/v merged and gate/up merged as the engine's compiled
#: step runs them (packed_linear_cat)
SHAPES = [("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, DIM, LAYERS), ("o", DIM, HEADS * HEAD_DIM, LAYERS),
          ("gate_up", 2 * HIDDEN, DIM, LAYERS), ("down", DIM, HIDDEN, LAYERS), ("head", VOCAB, DIM, 1)]


def best_of(fn, rounds: int) -> float:
    """Fewest seconds of this thread's CPU time one call took (a loaded host deschedules the thread:
    wall time would count that; everything here runs on the calling thread)."""
    return best_of_clock(fn, rounds, clock=time.thread_time)


def bandwidth(rounds: int) -> dict[str, float]:
    """One thread's read bandwidth (a C loop reading every word: ``_stream_read.c``; torch's ``sum``,
    which is slower than the memory on one thread) and copy bandwidth (read + write, both counted), GB/s."""
    big = torch.ones(128 * 2**20)  # 512 MiB
    dst = torch.empty_like(big)
    nbytes = big.numel() * big.element_size()
    found = {"read (torch sum fp32)": nbytes / best_of(big.sum, rounds) / 1e9,
             "copy (torch copy_, read+write)": 2 * nbytes / best_of(lambda: dst.copy_(big), rounds) / 1e9}
    lib = build_library("stream_read", [Path(__file__).with_name("_stream_read.c")],
                        ["-O3", "-fPIC", "-shared", "-march=native"], "the read-bandwidth loop")
    if lib is not None:
        lib.stream_read.argtypes, lib.stream_read.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_uint64
        words = nbytes // 8
        found["read (C loop)"] = nbytes / best_of(lambda: lib.stream_read(big.data_ptr(), words), rounds) / 1e9
    return found


def linears_sweep(dtype: torch.dtype, rounds: int) -> tuple[float, float] | None:
    """Seconds for one batch-1 pass over every packed linear (distinct weights: nothing stays in cache)
    and the weight bytes it read; None where the kernel does not run here."""
    if not decode_linear.available(dtype):
        return None
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _, n, k, count in SHAPES:
        for _ in range(count):
            w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
            layers.append((decode_linear.pack(w), n, torch.randn(1, k, generator=gen).to(dtype)))
    nbytes = sum(n * k * count for _, n, k, count in SHAPES) * dtype.itemsize

    def sweep() -> None:
        for packed, n, x in layers:
            decode_linear.linear(x, packed, n)

    return best_of(sweep, rounds), nbytes


def step_bytes(dtype: torch.dtype, context: int) -> dict[str, int]:
    """Bytes one batch-1 decode step reads, by kind."""
    weights = sum(n * k * count for _, n, k, count in SHAPES) * dtype.itemsize
    norms = (2 * LAYERS + 1) * DIM * dtype.itemsize
    kv = LAYERS * 2 * KV_HEADS * HEAD_DIM * context * dtype.itemsize
    return {"linear weights (incl. head)": weights, "norms": norms, f"KV cache ({context} tokens)": kv}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=48, help="tokens in the cache (32-token prompt + 32 new: 48 "
                        "on average)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, ISA level {isa.level()} (LOCKSTEP_CPU_ISA="
          f"{os.environ.get('LOCKSTEP_CPU_ISA', '')!r}), load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    bw = bandwidth(args.rounds)
    for name, value in bw.items():
        print(f"  {name}: {value:.1f} GB/s")
    read_bw = max(bw.values())  # the copy's read half alone would be faster still: the bound is optimistic
    print("\n| dtype | bytes / step (MB) | bound at read bandwidth (tok/s) | decode_linear kernel | linears pass "
          "(ms) | its weight GB/s | linears-only tok/s | kernel / bound |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        parts = step_bytes(dtype, args.context)
        total = sum(parts.values())
        bound = read_bw * 1e9 / total
        sweep = linears_sweep(dtype, args.rounds)
        if sweep is None:
            cells = "none here | | | | "
        else:
            seconds, nbytes = sweep
            cells = (f"{decode_linear.kernel(dtype, 960, 576)} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.1f} | "
                     f"{1 / seconds:.1f} | {1 / seconds / bound:.2f} |")
        print(f"| {str(dtype).removeprefix('torch.')} | {total / 1e6:.1f} | {bound:.1f} | {cells}")
        for name, value in parts.items():
            print(f"    {name}: {value / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
