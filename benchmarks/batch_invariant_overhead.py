"""Cost of batch-invariant mode: trainer step time and generator tokens/s, mode on vs off, same run.

Usage:
    .venv/bin/python benchmarks/batch_invariant_overhead.py [--recipe shakespeare] [--rounds 3] [--quick]

One model (the recipe's, fp32 weights; the trainer side uses the recipe's autocast dtype), measured
in alternating order (off, on, on, off, ...) so host-load drift hits both modes alike. Trainer: a
full step (forward, fp32 cross-entropy, backward, AdamW) on the recipe's batch. Generator: the
engine generating ``--new-tokens`` tokens for 16 prompts of mixed lengths (greedy, ignore EOS), and
for one prompt. Prints medians and the on/off ratios (target <= 1.5x).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from lockstep import numerics
from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
from lockstep.models.common.transformer import build_model
from lockstep.recipes import get_recipe


def train_step_seconds(model, optimizer, tokens, targets, dtype) -> float:
    autocast = (torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())
    start = time.perf_counter()
    with autocast:
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def generate_tokens_per_s(model, prompts, new_tokens: int) -> float:
    engine = Engine(model, None, EngineConfig(cache_memory_mb=256, max_batch_size=len(prompts)))
    requests = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
                for p in prompts]
    start = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / seconds


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
          f"tokens (fp32), {args.threads} threads")
    results: dict[tuple[str, bool], list[float]] = {}
    order = [False, True, True, False] * args.rounds
    for mode in [False, True]:  # warm-up, not recorded
        with numerics.batch_invariant(mode):
            numerics.prepare_model(model)
            train_step_seconds(model, optimizer, inputs, targets, dtype)
    for mode in order:
        with numerics.batch_invariant(mode):
            numerics.prepare_model(model)
            results.setdefault(("train_s", mode), []).append(
                train_step_seconds(model, optimizer, inputs, targets, dtype))
            with torch.no_grad():
                results.setdefault(("gen16_tok_s", mode), []).append(
                    generate_tokens_per_s(model, prompts, args.new_tokens))
                results.setdefault(("gen1_tok_s", mode), []).append(
                    generate_tokens_per_s(model, prompts[:1], args.new_tokens))
    print(f"{'measure':<24}{'off':>12}{'on':>12}{'slowdown':>10}")
    for name, label, slower in [("train_s", "trainer step (s)", lambda off, on: on / off),
                                ("gen16_tok_s", "generate b=16 (tok/s)", lambda off, on: off / on),
                                ("gen1_tok_s", "generate b=1 (tok/s)", lambda off, on: off / on)]:
        off, on = statistics.median(results[(name, False)]), statistics.median(results[(name, True)])
        print(f"{label:<24}{off:>12.3f}{on:>12.3f}{slower(off, on):>9.2f}x")
    numerics.set_batch_invariant(False)


if __name__ == "__main__":
    main()
