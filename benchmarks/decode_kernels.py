"""The generation engine's two decode kernels against what they replace, same process, interleaved.

Usage:
    .venv/bin/python benchmarks/decode_kernels.py [--rounds 5] [--rows 16]
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
"""

from __future__ import annotations

import argparse
import os
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, ISA level {isa.level()} (CPU {isa.detected()}), "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}, bf16 C kernel: {decode_linear.kernel()}")
    with torch.inference_mode():
        linears(args.rows, args.rounds)
        attention(args.rounds)


if __name__ == "__main__":
    main()
