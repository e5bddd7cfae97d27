"""Training throughput: lockstep's Trainer vs a plain loop over the same transformers model.

Same shapes, same token batches (the Shakespeare loader), same dtype (fp32 or bf16 autocast), same
thread count, same AdamW and clipping, measured in one process with the two interleaved in rounds
(this host's speed drifts, so only side-by-side ratios mean anything). Prints tokens/s, MFU and the
lockstep/HF ratio per dtype.

    .venv/bin/python benchmarks/train_throughput.py [--family llama3] [--flavor tiny] [--moe-flavor tiny] [--rounds 4]
    .venv/bin/python benchmarks/train_throughput.py --family qwen3_next,qwen3_5,gpt_oss --moe-flavor '' [--clock cpu]
    .venv/bin/python benchmarks/train_throughput.py --family '' --moe-flavor small --threads 1 --clock cpu  # MoE only

The MoE table runs lockstep's qwen3_moe with learned routing and with forced_balanced routing
(tokens spread evenly regardless of scores: a different workload, reported apart) against
transformers' Qwen3MoeForCausalLM with its own (learned) routing. ``--family`` takes a comma list
(the hybrid families run transformers' torch fallback of the chunked delta rule, as on any CPU without
flash-linear-attention). transformers runs SDPA attention where the model supports it, else eager
(GPT-OSS: sinks); the table says which.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from lockstep.models.registry import model_config
from lockstep.observe import mfu, peak_matmul_record
from lockstep.train.config import OutputConfig, TrainerConfig, TrainingConfig, ValidationConfig
from lockstep.train.optim import AdamWConfig, LRScheduleConfig
from lockstep.train.trainer import Trainer


#: wall time, or this process's CPU time (all its threads): steadier on a shared host, where wall time
#: counts the time other jobs hold the CPU (use with --threads 1; lockstep's side also pays for any
#: background thread of its Trainer)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def hf_model(cfg):
    """The transformers model of the same architecture, built through the family's HF adapter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lockstep.models.registry import get_model_spec

    hf_dict = dict(get_model_spec(cfg.family).hf_adapter.config_to_hf(cfg))
    model_type = hf_dict.pop("model_type")
    hf_dict.pop("architectures", None)
    hf_dict["use_cache"] = False
    hf_cfg = AutoConfig.for_model(model_type, **hf_dict)
    torch.manual_seed(0)
    try:
        return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    except ValueError:  # no SDPA path in transformers for this architecture (GPT-OSS's sinks)
        return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")


def with_routing(cfg, routing: str):
    """The same model config with every MoE layer's routing mode set to ``routing``."""
    return dataclasses.replace(cfg, feed_forward=dataclasses.replace(cfg.feed_forward, routing=routing))


class HFLoop:
    """The competitor: the loop a user would write around transformers."""

    def __init__(self, model, opt_cfg: AdamWConfig, dtype: torch.dtype, max_grad_norm: float) -> None:
        self.model, self.dtype, self.max_grad_norm = model, dtype, max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2),
                                           eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay)
        model.train()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype != torch.float32):
            logits = self.model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def measure(dtype_name: str, args, run_root: str, model_cfg, label: str) -> dict:
    config = TrainerConfig(
        recipe=f"bench-{dtype_name}", steps=10_000, run_dir=f"{run_root}/{label}-{dtype_name}", model=model_cfg,
        optimizer=AdamWConfig(lr=1e-3), lr_schedule=LRScheduleConfig(kind="constant", warmup_steps=0),
        training=TrainingConfig(batch_size=args.batch_size, seq_len=args.seq_len, dtype=dtype_name),
        validation=ValidationConfig(every=0), output=OutputConfig(progress=False, sample_tokens=0, parity_check=False),
    )
    trainer = Trainer(config)
    dtype = trainer.dtype
    # transformers has one routing mode (learned): its side always runs that
    hf_source = with_routing(model_cfg, "learned") if hasattr(model_cfg.feed_forward, "routing") else model_cfg
    hf = HFLoop(hf_model(hf_source), config.optimizer, dtype, config.training.max_grad_norm)
    batches = iter(trainer.data.train)
    tokens = config.training.batch_size * config.training.seq_len

    clock = CLOCKS[args.clock]

    def lockstep_steps(n: int, step0: int) -> float:
        start = clock()
        for i in range(n):
            trainer.train_step(step0 + i, batches)
        trainer.timer.pop()
        return n * tokens / (clock() - start)

    def hf_steps(n: int) -> float:
        data = [next(batches) for _ in range(n)]  # fetched outside the timed region (favours HF)
        start = clock()
        for inputs, targets in data:
            hf.step(inputs, targets)
        return n * tokens / (clock() - start)

    lockstep_steps(args.warmup, 1)
    hf_steps(args.warmup)
    ours, theirs = [], []
    step = args.warmup + 1
    for round_index in range(args.rounds):
        # ABBA order: each side goes first in half of the rounds, so drift hits both alike.
        if round_index % 2 == 0:
            ours.append(lockstep_steps(args.steps, step))
            theirs.append(hf_steps(args.steps))
        else:
            theirs.append(hf_steps(args.steps))
            ours.append(lockstep_steps(args.steps, step))
        step += args.steps
    peak = peak_matmul_record(dtype, torch.get_num_threads())["value"]
    ours_tps, theirs_tps = statistics.median(ours), statistics.median(theirs)
    return {
        "label": label,
        "dtype": dtype_name,
        "lockstep_tokens_per_s": ours_tps,
        "hf_tokens_per_s": theirs_tps,
        # paired per-round ratios: robust to the host's speed changing between rounds
        "ratio": statistics.median(a / b for a, b in zip(ours, theirs)),
        "ratio_min": min(a / b for a, b in zip(ours, theirs)),
        "ratio_max": max(a / b for a, b in zip(ours, theirs)),
        "lockstep_mfu": mfu(ours_tps, trainer.flops_per_token, peak),
        "hf_mfu": mfu(theirs_tps, trainer.flops_per_token, peak),
        "params": trainer.model.num_params(),
        "peak_gflops": peak / 1e9,
        "hf_attention": hf.model.config._attn_implementation,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama3", help="families for the first table (comma list)")
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--moe-flavor", default="tiny", help="qwen3_moe flavor for the MoE table ('' skips it)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="steps per round per side")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="see CLOCKS")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = [(f"{family} {args.flavor}", model_config(family, args.flavor))
            for family in args.family.split(",") if family]  # --family '': the MoE table only
    if args.moe_flavor:
        moe = model_config("qwen3_moe", args.moe_flavor)
        # different workloads: forced_balanced ignores the router, so its speed is not learned routing's
        runs += [(f"qwen3_moe {args.moe_flavor} learned", with_routing(moe, "learned")),
                 (f"qwen3_moe {args.moe_flavor} forced_balanced", with_routing(moe, "forced_balanced"))]
    print(f"batch {args.batch_size} x seq {args.seq_len}, threads {args.threads}, {args.clock} clock, "
          f"{args.rounds} interleaved rounds of {args.steps} steps (median; ratio = median of paired rounds)")
    print(f"{'model':<32} {'dtype':<9} {'lockstep tok/s':>14} {'HF tok/s':>9} {'ratio':>7} {'(range)':>12} "
          f"{'lockstep MFU':>12} {'HF MFU':>7} {'HF attn':>8}")
    with tempfile.TemporaryDirectory() as root:
        for label, cfg in runs:
            for dtype_name in args.dtypes.split(","):
                r = measure(dtype_name, args, root, cfg, label.replace(" ", "_"))
                print(f"{label:<32} {r['dtype']:<9} {r['lockstep_tokens_per_s']:>14.0f} {r['hf_tokens_per_s']:>9.0f} "
                      f"{r['ratio']:>6.2f}x {r['ratio_min']:>5.2f}-{r['ratio_max']:.2f}x "
                      f"{r['lockstep_mfu']:>11.1%} {r['hf_mfu']:>6.1%} {r['hf_attention']:>8}", flush=True)


if __name__ == "__main__":
    main()
