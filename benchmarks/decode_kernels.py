"""The generation engine's two decode kernels against what they replace, same process, interleaved.

Usage:
    .venv/bin/python benchmarks/decode_kernels.py [--rounds 5] [--rows 16] [--baseline REV [--only-baseline]]
    # a CPU without AMX, on one with it (lockstep's kernels and oneDNN's both capped before torch loads):
    LOCKSTEP_CPU_ISA=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 .venv/bin/python benchmarks/decode_kernels.py

1. bf16 linear at decode rows on SmolLM2-135M's shapes (q/k/v merged 960x576, o 576x576, gate/up
   merged 3072x576, down 576x1536, head 49152x576; 30 layers' worth of distinct weights each, so a
   sweep streams ~270 MB like one decode step): ``lockstep.ops.decode_linear`` (the C kernel of
   the ISA level: AMX, vdpbf16ps or plain C) vs oneDNN's prepacked linear
   (``mkldnn._linear_pointwise`` on ``_reorder_linear_weight``, the engine's ``"onednn"`` kernel) vs
   plain ``F.linear``. Per shape: microseconds a call and weight GB/s (best of rounds); the whole
   sweep: milliseconds, and the ratio oneDNN / C kernel (what ``linear_kernel="auto"`` decides on).
2. Decode attention, batch 16, 9 query / 3 kv heads of 64 (SmolLM2), 16-token blocks, 8-block
   tables, context 101: ``lockstep.ops.paged_attention`` (reads the pools in place) vs gathering the
   contexts and running SDPA (the engine's other path). "warm": one layer's pools in cache;
   "cold": 30 layers' pools (8.5 MB each) with 256 MB written between sweeps, as a decode step
   sees them.
3. With ``--baseline REV``: this checkout's C linears against the same files at git revision REV
   (built with the same flags, each side packing with its own ``pack``), bf16 (the level's kernel)
   and fp32 on the shapes of (1), at 1 and 16 rows (``--baseline-rows``): milliseconds a sweep by
   this thread's CPU time (best and median of ``--rounds``, the two sides interleaved), the ratio
   old / new, and whether every output is bitwise the same (``torch.equal``; a kernel whose
   arithmetic order is unchanged must give the same bits).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lockstep.ops import decode_linear, isa, paged_attention
from lockstep.ops.attention import sdpa_cached_attention

SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30), ("down", 576, 1536, 30),
          ("head", 49152, 576, 1)]


def best_of(fn, rounds: int, clock=time.perf_counter) -> float:
    """Fewest seconds one call of ``fn`` took by ``clock`` (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def linears(rows: int, rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    c_side = f"C {decode_linear.kernel()}"
    sides = {c_side: {}, "onednn": {}, "F.linear": {}}
    for name, n, k, layers in SHAPES:
        weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16) for _ in range(layers)]
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        packed = [decode_linear.pack(w) for w in weights] if decode_linear.available() else None
        reordered = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        if packed is not None:
            sides[c_side][name] = lambda x=x, packed=packed, n=n: [decode_linear.linear(x, p, n) for p in packed]
        sides["onednn"][name] = lambda x=x, r=reordered: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                                          for w in r]
        sides["F.linear"][name] = lambda x=x, weights=weights: [F.linear(x, w) for w in weights]
    print(f"bf16 linear, {rows} rows, {torch.get_num_threads()} threads (best of {rounds}):")
    print("| shape | N x K | " + " | ".join(f"{s} us/call (GB/s)" for s in sides) + " |")
    print("|---|---|" + "---|" * len(sides))
    for name, n, k, layers in SHAPES:
        cells = []
        for side in sides.values():
            if name not in side:
                cells.append("n/a")
                continue
            seconds = best_of(side[name], rounds) / layers
            cells.append(f"{seconds * 1e6:.1f} ({n * k * 2 / seconds / 1e9:.1f})")
        print(f"| {name} | {n}x{k} | " + " | ".join(cells) + " |")
    sweeps = {label: [] for label, side in sides.items() if side}
    for _ in range(rounds):  # whole sweeps, sides interleaved
        for label in sweeps:
            start = time.perf_counter()
            for fn in sides[label].values():
                fn()
            sweeps[label].append(time.perf_counter() - start)
    line = ", ".join(f"{label} {min(v) * 1e3:.2f} ms" for label, v in sweeps.items())
    print(f"sweep of every shape (~270 MB of weights): {line}")
    if c_side in sweeps:
        print(f"ratio oneDNN / {c_side} (sweep, best): {min(sweeps['onednn']) / min(sweeps[c_side]):.2f}x")


def attention(rounds: int) -> None:
    if not paged_attention.available():
        print("paged attention: no C compiler here, skipped")
        return
    batch, heads, kv_heads, d, block, width, layers, blocks = 16, 9, 3, 64, 16, 8, 30, 1400
    gen = torch.Generator().manual_seed(0)
    pools = [(torch.randn(blocks, block, kv_heads, d, generator=gen).to(torch.bfloat16),
              torch.randn(blocks, block, kv_heads, d, generator=gen).to(torch.bfloat16)) for _ in range(layers)]
    tables = torch.randint(1, blocks, (batch, width), generator=gen)
    positions = torch.full((batch, 1), 100)
    q = torch.randn(batch, heads, 1, d, generator=gen).to(torch.bfloat16)

    def gathered(k_pool, v_pool):
        k = k_pool.index_select(0, tables.reshape(-1)).view(batch, width * block, kv_heads, d).transpose(1, 2)
        v = v_pool.index_select(0, tables.reshape(-1)).view(batch, width * block, kv_heads, d).transpose(1, 2)
        return sdpa_cached_attention(q, k, v, q_positions=positions, scale=d**-0.5)

    def in_place(k_pool, v_pool):
        return torch.ops.lockstep.paged_decode_attention(q, k_pool, v_pool, tables, positions, d**-0.5)

    junk = torch.zeros(64 * 2**20)
    results = {"gather + SDPA": {"warm": [], "cold": []}, "in place": {"warm": [], "cold": []}}
    for _ in range(rounds):
        for label, fn in (("gather + SDPA", gathered), ("in place", in_place)):
            results[label]["warm"].append(best_of(lambda: fn(*pools[0]), 20))
            junk.add_(1)  # evict
            start = time.perf_counter()
            for k_pool, v_pool in pools:
                fn(k_pool, v_pool)
            results[label]["cold"].append((time.perf_counter() - start) / layers)
    print(f"\ndecode attention, batch {batch}, {heads}/{kv_heads} heads of {d}, context 101 (us a layer, best of {rounds}):")
    for label, r in results.items():
        print(f"  {label}: warm {min(r['warm']) * 1e6:.0f}, cold {min(r['cold']) * 1e6:.0f}")
    for kind in ("warm", "cold"):
        ratio = min(results["gather + SDPA"][kind]) / min(results["in place"][kind])
        print(f"  ratio gather+SDPA / in place ({kind}): {ratio:.2f}x")


def _baseline_fns(rev: str) -> dict[torch.dtype, tuple]:
    """(pack, linear) of the C linears at git revision ``rev``, built as ``decode_linear`` builds this
    checkout's (its own builders, pointed at a copy of ``rev``'s csrc/), per dtype at the current level."""
    csrc = Path(tempfile.mkdtemp(prefix="decode-kernels-baseline-"))
    root = Path(__file__).resolve().parents[1]
    for name in ("bf16_linear.c", "f32_linear.c", "amx_linear.c"):
        text = subprocess.run(["git", "show", f"{rev}:lockstep/ops/csrc/{name}"], cwd=root, capture_output=True,
                              text=True, check=True).stdout
        (csrc / name).write_text(text)
    use_amx, use_f32 = decode_linear.amx_available(), decode_linear.available(torch.float32)  # this checkout's, built
    here, decode_linear._CSRC = decode_linear._CSRC, csrc
    try:
        bf16_pack, bf16_fn = decode_linear._bf16_library.__wrapped__(isa.level())
        amx = decode_linear._amx_library.__wrapped__() if use_amx else None
        f32 = decode_linear._f32_library.__wrapped__() if use_f32 else None
    finally:
        decode_linear._CSRC = here
    found = {torch.bfloat16: (bf16_pack, amx or bf16_fn)}
    if f32 is not None:
        found[torch.float32] = f32
    return found


def baseline(rev: str, rows_list: list[int], rounds: int) -> None:
    """This checkout's C linears vs ``rev``'s on SmolLM2's shapes (section 3 of the module docstring)."""
    old = _baseline_fns(rev)
    gen = torch.Generator().manual_seed(0)
    print(f"\nC linears, this checkout vs {rev} (level {isa.level()}, {torch.get_num_threads()} threads, ms a sweep "
          f"of every shape by thread CPU time, best / median of {rounds}):")
    print("| dtype | kernel | rows | old ms | new ms | old / new (best) | old / new (median) | same bits |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, (old_pack, old_fn) in old.items():
        weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for _, n, k, layers in SHAPES
                   for _ in range(layers)]
        new_packed = [decode_linear.pack(w) for w in weights]
        old_packed = []
        for w in weights:
            n, k = w.shape
            packed = torch.empty_like(new_packed[len(old_packed)])
            old_pack(w.data_ptr(), packed.data_ptr(), n, k)
            old_packed.append(packed)
        for rows in rows_list:
            xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {w.shape[1] for w in weights}}
            outs = {side: [torch.empty(rows, w.shape[0], dtype=dtype) for w in weights] for side in ("old", "new")}

            def old_sweep(outs=outs["old"], xs=xs):
                for w, p, out in zip(weights, old_packed, outs):
                    old_fn(xs[w.shape[1]].data_ptr(), p.data_ptr(), None, out.data_ptr(), rows, w.shape[0], w.shape[1])

            new_fns = [decode_linear._kernel_fn(isa.level(), dtype, *w.shape) for w in weights]  # what linear() calls

            def new_sweep(outs=outs["new"], xs=xs):
                for w, p, out, fn in zip(weights, new_packed, outs, new_fns):
                    fn(xs[w.shape[1]].data_ptr(), p.data_ptr(), None, out.data_ptr(), rows, w.shape[0], w.shape[1])

            times = {"old": [], "new": []}
            old_sweep(), new_sweep()  # warm-up
            for i in range(rounds):  # interleaved, the order alternating
                for side, fn in (("old", old_sweep), ("new", new_sweep))[:: 1 if i % 2 else -1]:
                    start = time.thread_time()
                    fn()
                    times[side].append(time.thread_time() - start)
            same = all(torch.equal(a, b) for a, b in zip(outs["old"], outs["new"]))
            best = {side: min(t) for side, t in times.items()}
            med = {side: statistics.median(t) for side, t in times.items()}
            kernel = decode_linear.kernel(dtype, 960, 576)
            print(f"| {str(dtype).removeprefix('torch.')} | {kernel} | {rows} | {best['old'] * 1e3:.1f} | "
                  f"{best['new'] * 1e3:.1f} | {best['old'] / best['new']:.2f}x | {med['old'] / med['new']:.2f}x | "
                  f"{'yes' if same else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--baseline", default="", help="a git revision: compare its C linears with this checkout's")
    parser.add_argument("--baseline-rows", default="1,16", help="row counts of the --baseline comparison")
    parser.add_argument("--only-baseline", action="store_true", help="skip sections 1 and 2")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, ISA level {isa.level()} (CPU {isa.detected()}), "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}, bf16 C kernel: {decode_linear.kernel()}")
    with torch.inference_mode():
        if not args.only_baseline:
            linears(args.rows, args.rounds)
            attention(args.rounds)
        if args.baseline:
            baseline(args.baseline, [int(r) for r in args.baseline_rows.split(",")], args.rounds)


if __name__ == "__main__":
    main()
