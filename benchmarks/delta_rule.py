"""The chunked gated delta rule: lockstep's kernel vs transformers' torch fallback, forward and forward + backward.

Same inputs (L2-normed q/k, g < 0, beta in (0, 1)), same chunk size (64), same dtype and threads,
the two interleaved in rounds (this host's speed drifts; only side-by-side ratios mean anything).
transformers' ``torch_chunk_gated_delta_rule`` is what Qwen3-Next / Qwen3.5 run on a CPU without
flash-linear-attention. Prints ms per call and the transformers/lockstep time ratio per shape, for
the forward alone (no autograd graph: what a generator's prefill runs) and forward + backward.

    .venv/bin/python benchmarks/delta_rule.py [--rounds 5] [--threads 2] [--clock cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lockstep.models.common.delta_rule import chunk_gated_delta_rule, l2_normalize

#: (label, batch, tokens, heads, Dk, Dv): the qwen3_5 tiny flavor's layer at the training batch, and
#: the real models' head sizes (128) at fewer heads
SHAPES = [("tiny: 8 x 256, 8 heads of 32", 8, 256, 8, 32, 32),
          ("real heads: 2 x 512, 4 heads of 128", 2, 512, 4, 128, 128)]


def inputs(b: int, t: int, h: int, dk: int, dv: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    q = l2_normalize(torch.randn(b, t, h, dk, generator=gen)).to(dtype)
    k = l2_normalize(torch.randn(b, t, h, dk, generator=gen)).to(dtype)
    v = torch.randn(b, t, h, dv, generator=gen).to(dtype)
    g = (-torch.rand(b, t, h, generator=gen)).to(dtype)
    beta = torch.rand(b, t, h, generator=gen).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def timed(fn, xs, n: int, backward: bool) -> float:
    start = clock()
    for _ in range(n):
        if backward:
            out, _ = fn(*xs)
            out.float().square().sum().backward()
        else:
            with torch.no_grad():
                fn(*xs)
    return (clock() - start) / n


def main() -> None:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="calls per round per side")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="cpu: this process's CPU time, steadier than wall time on a shared host (use with --threads 1)")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    ours = lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)  # noqa: E731
    theirs = lambda q, k, v, g, beta: torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)  # noqa: E731
    print(f"chunk 64, threads {args.threads}, {args.clock} clock, {args.rounds} interleaved rounds of {args.calls} calls (median)")
    print(f"{'shape':<38} {'dtype':<9} {'pass':<8} {'lockstep ms':>11} {'HF ms':>8} {'HF / lockstep':>13} "
          f"{'(range)':>12}")
    for label, *shape in SHAPES:
        for dtype_name in args.dtypes.split(","):
            xs = inputs(*shape, getattr(torch, dtype_name))
            for backward in (False, True):
                timed(ours, xs, 1, backward), timed(theirs, xs, 1, backward)  # warm-up
                a, b, ratios = [], [], []
                for r in range(args.rounds):  # ABBA order
                    pair = (ours, theirs) if r % 2 == 0 else (theirs, ours)
                    times = {id(f): timed(f, xs, args.calls, backward) for f in pair}
                    a.append(times[id(ours)])
                    b.append(times[id(theirs)])
                    ratios.append(b[-1] / a[-1])
                print(f"{label:<38} {dtype_name:<9} {'fwd+bwd' if backward else 'fwd':<8} "
                      f"{statistics.median(a) * 1e3:>11.1f} {statistics.median(b) * 1e3:>8.1f} "
                      f"{statistics.median(ratios):>12.2f}x {min(ratios):>5.2f}-{max(ratios):.2f}x", flush=True)


if __name__ == "__main__":
    main()
