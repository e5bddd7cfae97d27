"""Training throughput: lockstep's Trainer vs a plain loop over Hugging Face LlamaForCausalLM.

Same shapes, same token batches (the Shakespeare loader), same dtype (fp32 or bf16 autocast), same
thread count, same AdamW and clipping, measured in one process with the two interleaved in rounds
(this host's speed drifts, so only side-by-side ratios mean anything). Prints tokens/s, MFU and the
lockstep/HF ratio per dtype.

    .venv/bin/python benchmarks/train_throughput.py [--flavor tiny] [--rounds 5] [--steps 6]
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


def hf_llama(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.resolved_head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope.theta, tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
        attn_implementation="sdpa", use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(hf_cfg)


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


def measure(dtype_name: str, args, run_root: str) -> dict:
    model_cfg = model_config("llama3", args.flavor)
    config = TrainerConfig(
        recipe=f"bench-{dtype_name}", steps=10_000, run_dir=f"{run_root}/{dtype_name}", model=model_cfg,
        optimizer=AdamWConfig(lr=1e-3), lr_schedule=LRScheduleConfig(kind="constant", warmup_steps=0),
        training=TrainingConfig(batch_size=args.batch_size, seq_len=args.seq_len, dtype=dtype_name),
        validation=ValidationConfig(every=0), output=OutputConfig(progress=False, sample_tokens=0),
    )
    trainer = Trainer(config)
    dtype = trainer.dtype
    hf = HFLoop(hf_llama(model_cfg), config.optimizer, dtype, config.training.max_grad_norm)
    batches = iter(trainer.data.train)
    tokens = config.training.batch_size * config.training.seq_len

    def lockstep_steps(n: int, step0: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            trainer.train_step(step0 + i, batches)
        trainer.timer.pop()
        return n * tokens / (time.perf_counter() - start)

    def hf_steps(n: int) -> float:
        data = [next(batches) for _ in range(n)]  # fetched outside the timed region (favours HF)
        start = time.perf_counter()
        for inputs, targets in data:
            hf.step(inputs, targets)
        return n * tokens / (time.perf_counter() - start)

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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="steps per round per side")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"llama3 {args.flavor}: batch {args.batch_size} x seq {args.seq_len}, threads {args.threads}, "
          f"{args.rounds} interleaved rounds of {args.steps} steps (median)")
    print(f"{'dtype':<10} {'lockstep tok/s':>15} {'HF tok/s':>10} {'ratio':>7} {'(range)':>13} "
          f"{'lockstep MFU':>13} {'HF MFU':>8}")
    with tempfile.TemporaryDirectory() as root:
        for dtype_name in args.dtypes.split(","):
            r = measure(dtype_name, args, root)
            print(f"{r['dtype']:<10} {r['lockstep_tokens_per_s']:>15.0f} {r['hf_tokens_per_s']:>10.0f} "
                  f"{r['ratio']:>6.2f}x {r['ratio_min']:>6.2f}-{r['ratio_max']:.2f}x "
                  f"{r['lockstep_mfu']:>12.1%} {r['hf_mfu']:>7.1%}")


if __name__ == "__main__":
    main()
