"""The pretraining/SFT loop: one config tree in, a run directory of metrics, manifest and weights out.

A step is: fetch micro-batches (``time/data``), forward + loss (``time/forward``), backward
(``time/backward``), clip + optimizer (``time/optimizer``); the stage times, throughput and MFU of
every step go to ``metrics.jsonl``. Validation and checkpoint-like work are kept out of step time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from lockstep import numerics
from lockstep.config.base import ConfigError, to_dict
from lockstep.data.config import DataBundle
from lockstep.models.common.transformer import Transformer, build_model
from lockstep.observe import (
    MetricsWriter,
    ProgressBar,
    RunManifest,
    StageTimer,
    mfu,
    peak_matmul_record,
    peak_rss_bytes,
    plot_loss,
    read_metrics,
)
from lockstep.parallel.runtime import ParallelRuntime
from lockstep.train.config import TrainerConfig
from lockstep.train.sample import greedy_continue

DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class TrainResult:
    run_dir: Path
    losses: list[float]
    val_losses: dict[int, float]
    sample: str | None


def default_run_dir(recipe: str) -> Path:
    return Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"


def truncate_metrics(path: Path, step: int) -> dict[int, float]:
    """Drop records past ``step`` (written after the checkpoint a run resumes from); returns the
    kept validation losses."""
    if not path.exists():
        return {}
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    return {r["step"]: r["val_loss"] for r in kept if "val_loss" in r}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def save_weights(state: dict[str, torch.Tensor], path: Path, tied: bool) -> None:
    """Write a state dict as safetensors (a tied head is stored once, under the embedding)."""
    state = {k: v.detach().contiguous() for k, v in state.items()}
    if tied:
        state.pop("output.weight", None)
    save_file(state, str(path))


class Trainer:
    """Builds every component from a ``TrainerConfig`` and runs the loop."""

    def __init__(self, config: TrainerConfig) -> None:
        config.validate()
        self.config = config
        cfg = config.training
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(config.seed)
        self.runtime = ParallelRuntime.create(config.parallel)
        dp = self.runtime.dims.dp
        if cfg.batch_size % dp:
            raise ConfigError(f"training.batch_size: {cfg.batch_size} is not divisible by the {dp} "
                              "data-parallel ranks")
        if self.runtime.dims.pp > 1:
            from lockstep.parallel.pipeline import stages_per_rank, validate_pipeline

            par = config.parallel
            try:
                validate_pipeline(par.pp_schedule, par.pp,
                                  par.pp_microbatches or par.pp * stages_per_rank(par.pp_schedule),
                                  n_layers=config.model.n_layers, batch_size=cfg.batch_size // dp)
            except ValueError as err:
                raise ConfigError("parallel." + str(err).replace("n_microbatches:", "pp_microbatches:", 1)) from None
        self.run_dir = Path(config.run_dir) if config.run_dir else default_run_dir(config.recipe)
        from lockstep.train.checkpointing import check_run_dir

        check_run_dir(config.checkpoint, self.run_dir, config.resume)
        self._barrier()  # nobody creates the run dir before every rank has checked it was free
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # resolved before the data: a pretrained model's tokenizer lives in its directory
        self.init_path = None
        if config.init_from:
            from lockstep.models.hf.pretrained import resolve_pretrained

            self.init_path = resolve_pretrained(config.init_from)
        self.data: DataBundle = config.data.build(seq_len=cfg.seq_len, batch_size=cfg.batch_size // dp,
                                                  seed=config.seed, rank=self.runtime.dp_rank, world_size=dp)
        if self.data.tokenizer.vocab_size > config.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size: {config.model.vocab_size} is smaller than the tokenizer's "
                f"{self.data.tokenizer.vocab_size} tokens"
            )
        # Every rank materialises the same seeded weights, then the plan shards them: a layout
        # starts from exactly the single-process initial weights.
        if self.init_path is not None:
            from lockstep.models.hf.pretrained import load_pretrained

            model = load_pretrained(self.init_path, config=config.model, dtype=torch.float32)
        else:
            model = build_model(config.model, seed=config.seed)
        self.flops_per_token = model.flops_per_token(cfg.seq_len)
        self.model_info = self._model_info(model)
        config.numerics.build()  # the process-wide switch; the model's kernels follow it
        self.agreement = None
        if config.numerics.batch_invariant:
            numerics.prepare_model(model)  # before parallelize: FSDP changes module classes
            if self.runtime.world_size == 1:
                from lockstep.rl.agreement import measure_agreement

                self.agreement = measure_agreement(model, seed=config.seed)
        self.model: Transformer = self.runtime.parallelize(model, config.parallel, cfg.activation_checkpoint)
        self.pipeline = self.runtime.pipeline  # None unless pp > 1: then self.model holds this rank's stages
        self.optimizer = config.optimizer.build(self.model)
        self.lr_at = config.lr_schedule.build(peak_lr=config.optimizer.lr, total_steps=config.steps)
        self.dtype = DTYPE[cfg.dtype]
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum  # global, all ranks
        # tokens_per_step counts every rank's tokens, so MFU is against every rank's peak.
        self.peak = {**peak_matmul_record(self.dtype, torch.get_num_threads()),
                     "ranks": self.runtime.world_size}
        self.timer = StageTimer()
        self.checkpointing = None
        self.start_step, self.resumed = 0, None
        if config.checkpoint.every or config.resume:
            from lockstep.train.checkpointing import TrainCheckpointing

            self.checkpointing = TrainCheckpointing(self)
            self._barrier()  # rank 0 has cleared interrupted saves before anyone writes
            if config.resume:
                self.resumed = self.checkpointing.resume()
                self.start_step = self.resumed["from_step"]
        self.manifest = self._manifest() if self.runtime.is_main else None

    def _barrier(self) -> None:
        if self.runtime.distributed:
            torch.distributed.barrier()

    def _model_info(self, model: Transformer) -> dict:
        """What the manifest says of the model, taken before parallelism splits or shards it."""
        return {
            "model": {
                "family": self.config.model.family,
                "flavor": self.config.model.flavor,
                "parameters": model.num_params(),
                "parameters_without_embedding": model.num_params(exclude_embedding=True),
                "flops_per_token": self.flops_per_token,
                "seq_len": self.config.training.seq_len,
            },
            "attention": sorted({layer.attention.backend_name for layer in model.layers.values()}),
            # forced_balanced ignores the router: its throughput is not learned routing's
            "moe_routing": sorted({m.routing_mode for m in model.modules() if hasattr(m, "routing_mode")}) or None,
        }

    def _manifest(self) -> RunManifest:
        info = self.model_info
        manifest = RunManifest(self.run_dir, recipe=to_dict(self.config), model=info["model"])
        manifest.update(
            kernels={
                "attention": info["attention"],
                "moe_routing": info["moe_routing"],
                "compute_dtype": self.config.training.dtype,
                "autocast": self.dtype != torch.float32,
            },
            numerics={**numerics.thread_settings(), "agreement": self.agreement},
            determinism={
                "seed": self.config.seed,
                "threads": torch.get_num_threads(),
                "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                "note": "same recipe, seed, machine and thread count give bitwise identical losses",
            },
            peak_flops=self.peak,
            data={
                "dataset": self.config.data.dataset,
                "tokenizer_vocab": self.data.tokenizer.vocab_size,
                "train_tokens": self.data.train_tokens,
                "val_tokens": self.data.val_tokens,
            },
            transforms=list(self.config.transforms),
            init_from={"name": self.config.init_from, "path": str(self.init_path)} if self.init_path else None,
            resumed=self.resumed,
            checkpoint={"every": self.config.checkpoint.every, "mode": self.config.checkpoint.mode,
                        "storage": self.checkpointing.checkpointer.storage.describe()}
            if self.checkpointing is not None else None,
            parallel=self.runtime.describe(self.config.model.family, self.config.parallel),
        )
        if self.agreement is not None:
            manifest.add_check("batch_invariance", self.agreement["logprob_diff/max"] == 0.0
                               and self.agreement["batch_vs_alone/max"] == 0.0, **self.agreement)
        if self.config.output.parity_check:
            from lockstep.models.hf.parity import family_parity

            result = family_parity(self.config.model.family)
            manifest.add_check("hf_parity", bool(result.pop("passed")), **result)
        manifest.write()
        return manifest

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.dtype)

    def train_step(self, step: int, batches) -> dict[str, float]:
        cfg = self.config.training
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total_loss = 0.0
        extra: dict[str, float] = {}
        for _ in range(cfg.grad_accum):
            with self.timer.stage("data"):
                inputs, targets = next(batches)
            if self.pipeline is not None:  # the schedule interleaves forward and backward
                with self.timer.stage("forward_backward"), self._autocast():
                    local = self.pipeline.step(inputs, targets, loss_scale=1.0 / cfg.grad_accum)
                total_loss += self.runtime.mean_over_dp(self.pipeline.broadcast_loss(local)) / cfg.grad_accum
                continue
            if self.runtime.context is not None:  # this rank's share of each sequence
                inputs, targets, positions = self.runtime.context.shard_batch(inputs, targets)
                with self.timer.stage("forward"), self._autocast():
                    loss, main = self.runtime.context.cross_entropy(self.model(inputs, positions=positions), targets)
                    aux_losses, aux_metrics = self.model.pop_auxiliary()
                    loss = (loss + sum(aux_losses.values())) / cfg.grad_accum
                with self.timer.stage("backward"):
                    loss.backward()
                total_loss += self.runtime.mean_over_dp(main) / cfg.grad_accum
                continue
            with self.runtime.loss_context():
                with self.timer.stage("forward"), self._autocast():
                    main = lm_loss(self.model(inputs), targets)
                    aux_losses, aux_metrics = self.model.pop_auxiliary()
                    loss = (main + sum(aux_losses.values())) / cfg.grad_accum
                with self.timer.stage("backward"):
                    loss.backward()
            total_loss += self.runtime.mean_over_dp(main.detach()) / cfg.grad_accum
            for name, value in [*((f"aux_loss/{k}", float(v.detach())) for k, v in aux_losses.items()),
                                *aux_metrics.items()]:
                extra[name] = extra.get(name, 0.0) + value / cfg.grad_accum
        with self.timer.stage("optimizer"):
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
            self.runtime.sync_context_grads(self.model)
            self.runtime.after_backward(self.model)
            grad_norm = float(self.runtime.clip_grad_norm(self.model, max_norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {"loss": total_loss, "lr": lr, "grad_norm": grad_norm, **extra}

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        limit = self.config.validation.batches or None
        for i, (inputs, targets) in enumerate(self.data.val.iter_epoch()):
            if limit is not None and i >= limit:
                break
            if self.pipeline is not None:
                with self._autocast():
                    loss = self.pipeline.broadcast_loss(self.pipeline.eval_loss(inputs, targets))
                losses.append(self.runtime.mean_over_dp(loss))
                continue
            if self.runtime.context is not None:
                inputs, targets, positions = self.runtime.context.shard_batch(inputs, targets)
                with self._autocast():
                    _, loss = self.runtime.context.cross_entropy(self.model(inputs, positions=positions), targets)
                losses.append(self.runtime.mean_over_dp(loss))
                continue
            with self.runtime.loss_context(), self._autocast():
                losses.append(self.runtime.mean_over_dp(lm_loss(self.model(inputs), targets).detach()))
        self.model.train()
        return sum(losses) / max(len(losses), 1)

    def fit(self) -> TrainResult:
        try:
            return self._fit()
        finally:
            if self.checkpointing is not None:
                self.checkpointing.close()  # finishes an in-flight save

    def _fit(self) -> TrainResult:
        cfg, steps = self.config, self.config.steps
        last = cfg.stop_after or steps
        batches = iter(self.data.train)
        losses: list[float] = []
        val_losses: dict[int, float] = {}
        main = self.runtime.is_main
        bar = ProgressBar(last, desc=cfg.recipe, enabled=cfg.output.progress and main)
        # rank 0 writes the run's metrics; other ranks keep their own log beside it
        log_path = self.run_dir / ("metrics.jsonl" if main else f"logs/rank{self.runtime.rank}.jsonl")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.resumed:
            val_losses = truncate_metrics(log_path, self.start_step)
        initial_val = self.evaluate() if cfg.validation.every and not self.resumed else None
        if initial_val is not None:
            val_losses[0] = initial_val
        with MetricsWriter(log_path) as writer:
            if initial_val is not None:
                writer.write({"step": 0, "val_loss": initial_val})
            self.model.train()
            for step in range(self.start_step + 1, last + 1):
                started = time.perf_counter()
                record = {"step": step, **self.train_step(step, batches)}
                stages = self.timer.pop()
                seconds = time.perf_counter() - started
                tokens_per_s = self.tokens_per_step / seconds
                record.update(
                    tokens=self.tokens_per_step * step,
                    tokens_per_s=tokens_per_s,
                    mfu=mfu(tokens_per_s, self.flops_per_token,
                            self.peak["value"] * self.peak["ranks"]),
                    **stages,
                    **{"time/step": seconds},
                    peak_rss_bytes=peak_rss_bytes(),
                )
                every = cfg.validation.every
                if every and (step % every == 0 or step == steps):
                    record["val_loss"] = val_losses[step] = self.evaluate()
                losses.append(record["loss"])
                writer.write(record)
                bar.update(step, loss=record["loss"], tokens_per_s=tokens_per_s)
                if self.checkpointing is not None:
                    if self.checkpointing.due(step, last):
                        self.checkpointing.save(step)
                    for ckpt in self.checkpointing.records(wait=step == last):
                        writer.write({"step": step, **ckpt})
        bar.close()
        return self._finish(losses, val_losses)

    def _finish(self, losses: list[float], val_losses: dict[int, float]) -> TrainResult:
        main = self.runtime.is_main
        out = self.config.output
        if main:
            records = read_metrics(self.run_dir / "metrics.jsonl")
            plot_loss([r for r in records if "loss" in r], self.run_dir / "loss.png",
                      val_metrics=[r for r in records if "val_loss" in r])
        if out.save_weights:
            state = self.runtime.full_state_dict(self.model)  # collective
            if main:
                save_weights(state, self.run_dir / "model.safetensors", self.config.model.tie_embeddings)
                shutil.copyfile(self.config.data.resolved_tokenizer_path(), self.run_dir / "tokenizer.json")
        sample = None
        # Sequence-parallel TP needs lengths divisible by tp; the quick full-prefix sampler does not pad.
        if out.sample_tokens and self.runtime.dims.tp == 1 and self.pipeline is None and self.runtime.context is None:
            tok = self.data.tokenizer
            ids = greedy_continue(self.model, tok.encode(out.sample_prompt), out.sample_tokens,
                                  self.config.training.seq_len, stop_id=tok.eos_id)
            sample = out.sample_prompt + tok.decode(ids)
        first_val = val_losses.get(0)
        last_val = val_losses[max(val_losses)] if val_losses else None
        if not main:
            return TrainResult(self.run_dir, losses, val_losses, sample)
        self.manifest.update(result={
            "steps": len(losses),
            "final_loss": losses[-1] if losses else None,
            "initial_val_loss": first_val,
            "final_val_loss": last_val,
            "sample": sample,
        })
        self.manifest.write()
        return TrainResult(self.run_dir, losses, val_losses, sample)
