"""Cost of batch-invariant mode: trainer step time and generator tokens/s, mode on vs off, same run.

Usage:
    .venv/bin/python benchmarks/batch_invariant_overhead.py [--recipe shakespeare] [--rounds 3] [--quick]

Kernels follow the CPU's ISA level (``lockstep.ops.isa``); to measure a CPU without AMX on one with
it, cap both lockstep's kernels and oneDNN's (set before torch loads):
    LOCKSTEP_CPU_ISA=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 .venv/bin/python benchmarks/batch_invariant_overhead.py
The header names the level, the oneDNN cap and the bf16 linear kernel in use.

One model (the recipe's, fp32 weights; the trainer side uses the recipe's autocast dtype), measured
in alternating order (off, on, on, off, ...) so host-load drift hits both modes alike. Trainer: a
full step (forward, fp32 cross-entropy, backward, AdamW) on the recipe's batch. Generator: the
engine generating ``--new-tokens`` tokens for 16 prompts of mixed lengths (greedy, ignore EOS), and
for one prompt, on the fp32 weights and on a bf16 copy (``EngineConfig.weights_dtype``). Prints medians with [min, max] and the on/off ratios (target <= 1.5x), by wall
time and by process CPU time (with ``--threads 1`` the CPU time excludes the time the process waits
for a core, so it is the steadier measure on a shared host), and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.nn.functional as F

from lockstep import numerics
from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
from lockstep.models.common.transformer import build_model
from lockstep.ops import decode_linear, isa
from lockstep.recipes import get_recipe


class Clock:
    """Wall and process-CPU seconds of a block."""

    def __enter__(self) -> "Clock":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def train_step_seconds(model, optimizer, tokens, targets, dtype) -> tuple[float, float]:
    autocast = (torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())
    with Clock() as clock:
        with autocast:
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return clock.wall, clock.cpu


def generate_tokens_per_s(model, prompts, new_tokens: int, weights_dtype: str = "model") -> tuple[float, float]:
    engine = Engine(model, None, EngineConfig(cache_memory_mb=256, max_batch_size=len(prompts),
                                              weights_dtype=weights_dtype))
    requests = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
                for p in prompts]
    with Clock() as clock:
        results = engine.generate(requests)
    tokens = sum(len(r.token_ids) for r in results)
    return tokens / clock.wall, tokens / clock.cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="shakespeare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the debug recipe, 1 round: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.recipe, args.rounds, args.new_tokens = "debug", 1, 16
    torch.set_num_threads(args.threads)
    cfg = get_recipe(args.recipe).config()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.training.dtype]
    model = numerics.prepare_model(build_model(cfg.model, seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    batch, seq = cfg.training.batch_size, cfg.training.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    prompts = [torch.randint(0, cfg.model.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 96, (16,), generator=g)]
    print(f"recipe {args.recipe}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"train batch {batch}x{seq} ({cfg.training.dtype}), generate 16 + 1 prompts x {args.new_tokens} "
          f"tokens (fp32 and bf16 weights), {args.threads} threads")
    print(f"ISA level {isa.level()} (CPU: {isa.detected()}; LOCKSTEP_CPU_ISA={os.environ.get(isa.ENV)}), "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}, bf16 linear kernel "
          f"{decode_linear.kernel()}, fp32 {decode_linear.kernel(torch.float32)}")
    results: dict[tuple[str, str, bool], list[float]] = {}

    def record(name: str, mode: bool, values: tuple[float, float]) -> None:
        for clock, value in zip(("wall", "cpu"), values):
            results.setdefault((clock, name, mode), []).append(value)

    order = [False, True, True, False] * args.rounds
    for mode in [False, True]:  # warm-up, not recorded
        with numerics.batch_invariant(mode):
            numerics.prepare_model(model)
            train_step_seconds(model, optimizer, inputs, targets, dtype)
    load_before = os.getloadavg()
    for mode in order:
        with numerics.batch_invariant(mode):
            numerics.prepare_model(model)
            record("train_s", mode, train_step_seconds(model, optimizer, inputs, targets, dtype))
            with torch.no_grad():
                record("gen16_tok_s", mode, generate_tokens_per_s(model, prompts, args.new_tokens))
                record("gen1_tok_s", mode, generate_tokens_per_s(model, prompts[:1], args.new_tokens))
                record("gen16_bf16_tok_s", mode, generate_tokens_per_s(model, prompts, args.new_tokens, "bfloat16"))
                record("gen1_bf16_tok_s", mode, generate_tokens_per_s(model, prompts[:1], args.new_tokens, "bfloat16"))
    load_after = os.getloadavg()
    for clock in ("wall", "cpu"):
        print(f"\nby {clock} time: median [min, max] of {2 * args.rounds} runs per mode")
        print(f"{'measure':<24}{'off':>28}{'on':>28}{'slowdown':>10}{'best/best':>11}")
        for name, label, slower in [("train_s", "trainer step (s)", lambda off, on: on / off),
                                    ("gen16_tok_s", "generate b=16 (tok/s)", lambda off, on: off / on),
                                    ("gen1_tok_s", "generate b=1 (tok/s)", lambda off, on: off / on),
                                    ("gen16_bf16_tok_s", "gen bf16 b=16 (tok/s)", lambda off, on: off / on),
                                    ("gen1_bf16_tok_s", "gen bf16 b=1 (tok/s)", lambda off, on: off / on)]:
            best = min if name == "train_s" else max  # each mode's least disturbed run (a loaded host)
            cells = []
            for mode in (False, True):
                values = results[(clock, name, mode)]
                cells.append(f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]")
            off, on = (statistics.median(results[(clock, name, mode)]) for mode in (False, True))
            off_best, on_best = (best(results[(clock, name, mode)]) for mode in (False, True))
            print(f"{label:<24}{cells[0]:>28}{cells[1]:>28}{slower(off, on):>9.2f}x{slower(off_best, on_best):>10.2f}x")
    print(f"\nload average (1, 5, 15 min) before {load_before}, after {load_after}")
    numerics.set_batch_invariant(False)


if __name__ == "__main__":
    main()
