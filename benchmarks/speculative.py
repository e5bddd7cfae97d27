"""MTP speculative decoding vs plain greedy decoding on a trained DeepSeek-V3-style model.

A random model's MTP head agrees with its main head about as often as chance, so this first trains
a small ``deepseek_v3`` (the ``debug`` flavor: MLA, a dense layer then MoE, one MTP depth) on the
Shakespeare corpus for ``--train-steps`` steps with the MTP loss (a plain AdamW loop, cached in
``--model-path``: later runs reuse it), then generates from validation-split prompts with
``EngineConfig.speculative="mtp"`` at each ``--draft-tokens`` k and with plain decoding, greedy, the
engines interleaved round by round in one process. It prints tokens/s of each side (median and best
round), the median of per-round ratios to plain decoding and the ratio of best rounds, the
acceptance rate (drafted tokens accepted / drafted) and the tokens emitted per verify forward, and
checks every speculative output is token-identical to the plain one.

    .venv/bin/python benchmarks/speculative.py [--train-steps 400] [--draft-tokens 1,2,3]
        [--batches 1,8] [--new-tokens 64] [--rounds 3] [--model-path /tmp/lockstep-dsv3-mtp.pt] [--threads N]

Training saves ``<model-path>.step<N>`` every 25 steps; ``--model-path`` of such a file with
``--train-steps N`` benchmarks that checkpoint (a run cut short on a busy host).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lockstep.data.config import DataConfig
from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config


def train_model(path: Path, steps: int, seq_len: int = 128, batch: int = 8, lr: float = 3e-3):
    """A ``deepseek_v3`` debug model trained on Shakespeare with its MTP loss (cached at ``path``)."""
    model = build_model(model_config("deepseek_v3", "debug"), seed=0)
    data = DataConfig().build(seq_len=seq_len, batch_size=batch, seed=0)
    if path.is_file():
        model.load_state_dict(torch.load(path, weights_only=True))
        return model, data
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    warmup = max(1, steps // 20)
    def lr_factor(step: int) -> float:  # linear warm-up, cosine decay to 0.1
        return min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        inputs, targets = next(data.train)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        aux, _ = model.pop_auxiliary()
        (loss + sum(aux.values())).backward()
        aux = {k: v.detach() for k, v in aux.items()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        model.after_optimizer_step()
        if (step + 1) % 25 == 0:  # a usable checkpoint on a slow, shared host: <path>.step<N>
            torch.save(model.state_dict(), path.with_name(f"{path.name}.step{step + 1}"))
        if step % 50 == 0 or step == steps - 1:
            mtp = float(aux["mtp/loss"]) / model.config.mtp_loss_weight if "mtp/loss" in aux else float("nan")
            print(f"train step {step}: loss {loss.item():.3f} mtp loss {mtp:.3f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    model.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return model, data


def val_prompts(data, batch: int, length: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens from the validation split (text the model has not seen)."""
    tokens = data.val.tokens
    stride = max(1, (tokens.numel() - length) // max(1, batch))
    return [tokens[i * stride: i * stride + length].long().tolist() for i in range(batch)]


def run(engine: Engine, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate([Request(prompt_ids=p, sampling=sp) for p in prompts])
    return time.perf_counter() - start, [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-steps", type=int, default=400)
    parser.add_argument("--model-path", default="/tmp/lockstep-dsv3-mtp.pt")
    parser.add_argument("--draft-tokens", default="1,2,3")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-only", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, data = train_model(Path(args.model_path), args.train_steps)
    if args.train_only:
        return
    model.eval()
    drafts = [int(k) for k in args.draft_tokens.split(",")]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, model deepseek_v3 debug "
          f"trained {args.train_steps} steps, prompt {args.prompt_len} tokens, {args.new_tokens} new, fp32 greedy")
    print(f"{'batch':>5} {'side':>8} {'tok/s':>8} {'best':>8} {'x plain':>8} {'best x':>7} {'accept':>7} "
          f"{'tok/verify':>10}")
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = val_prompts(data, batch, args.prompt_len)
        sides = {"plain": Engine(model, None, EngineConfig(max_batch_size=batch, cache_memory_mb=64))}
        for k in drafts:
            sides[f"mtp k={k}"] = Engine(model, None, EngineConfig(max_batch_size=batch, cache_memory_mb=64,
                                                                   speculative="mtp", draft_tokens=k))
        for engine in sides.values():  # warm-up (first-call allocations)
            run(engine, prompts, 4)
        times: dict[str, list[float]] = {name: [] for name in sides}
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, engine in sides.items():
                if engine.speculator is not None:
                    engine.speculator.stats.reset()
                seconds, outputs[name] = run(engine, prompts, args.new_tokens)
                times[name].append(seconds)
        tokens = batch * args.new_tokens
        plain = times["plain"]
        for name, engine in sides.items():
            if outputs[name] != outputs["plain"]:
                raise SystemExit(f"{name}: greedy output differs from plain decoding at batch {batch}")
            ratio = statistics.median(p / s for p, s in zip(plain, times[name]))
            stats = engine.speculator.stats if engine.speculator is not None else None
            accept = f"{stats.acceptance_rate:.2f}" if stats else "-"
            per_verify = f"{stats.tokens_per_verify:.2f}" if stats else "-"
            best = min(plain) / min(times[name])  # each side's least disturbed round (a shared host)
            print(f"{batch:>5} {name:>8} {tokens / statistics.median(times[name]):>8.1f} "
                  f"{tokens / min(times[name]):>8.1f} {ratio:>8.2f} {best:>7.2f} {accept:>7} {per_verify:>10}",
                  flush=True)


if __name__ == "__main__":
    main()
