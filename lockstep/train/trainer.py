"""The pretraining/SFT loop: one config tree in, a run directory of metrics, manifest and weights out.

A step is: fetch micro-batches (``time/data``), forward + loss (``time/forward``), backward
(``time/backward``) through the runtime's step seam (``ParallelRuntime.loss_and_backward``, one per
micro-batch, no host synchronisation), clip + optimizer (``time/optimizer``); the step's scalars are
reduced over ranks once. The stage times, throughput and MFU of every step go to the run's sinks
(``metrics.jsonl``, TensorBoard, W&B). Validation and checkpoint-like work are kept out of step time.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from pathlib import Path

import torch

from lockstep import numerics
from lockstep.compile.blocks import apply_compile
from lockstep.config.base import ConfigError, to_dict
from lockstep.data.config import DataBundle
from lockstep.graph.step import graph_manifest
from lockstep.models.common.transformer import Transformer, build_model
from lockstep.observe import RunManifest, StageTimer, mfu, peak_matmul_record, peak_rss_bytes, plot_loss, read_metrics
from lockstep.parallel.runtime import ParallelRuntime, lm_loss  # noqa: F401  (lm_loss: re-exported)
from lockstep.run import RunLog, agree_on_run_dir, save_weights, seed_everything
from lockstep.run.manifest import model_kernels, run_manifest
from lockstep.run.nonfinite import NonFiniteGuard, nonfinite_values
from lockstep.train.config import TrainerConfig
from lockstep.train.sample import greedy_continue

DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class TrainResult:
    run_dir: Path
    losses: list[float]
    val_losses: dict[int, float]
    sample: str | None


class Trainer:
    """Builds every component from a ``TrainerConfig`` and runs the loop."""

    def __init__(self, config: TrainerConfig) -> None:
        config.validate()
        self.config = config
        cfg = config.training
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(config.seed)
        self.dtype = DTYPE[cfg.dtype]
        self.runtime = ParallelRuntime.create(config.parallel, device=cfg.device, dtype=self.dtype)
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
        # rank 0 checks and creates the directory; every rank uses the one it chose
        self.run_dir = agree_on_run_dir(config, main=self.runtime.is_main, group=self.runtime.group,
                                        distributed=self.runtime.distributed)
        # resolved before the data: a pretrained model's tokenizer lives in its directory
        self.init_path = None
        if config.init_from:
            from lockstep.load import resolve_source

            self.init_path = resolve_source(config.init_from, "init_from")
        self.data: DataBundle = config.data.build(seq_len=cfg.seq_len, batch_size=cfg.batch_size // dp,
                                                  seed=config.seed, rank=self.runtime.dp_rank, world_size=dp,
                                                  model_config=config.model)
        if self.data.tokenizer.vocab_size > config.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size: {config.model.vocab_size} is smaller than the tokenizer's "
                f"{self.data.tokenizer.vocab_size} tokens"
            )
        # Every rank materialises the same seeded weights, then the plan shards them: a layout
        # starts from exactly the single-process initial weights.
        if self.init_path is not None:
            from lockstep.load import load_model

            model = load_model(self.init_path, config=config.model, dtype=torch.float32, tokenizer=False,
                               field="init_from", allow_unverified=config.allow_unverified_weights).model
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
        self.low_precision = None
        if config.low_precision.enabled:  # on the unsplit model, before parallelism wraps its modules
            from lockstep.convert import convert_model

            self.low_precision = convert_model(model, config.low_precision, self.runtime.device)
            if self.runtime.is_main:
                print(self.low_precision.summary(), flush=True)
        self.model: Transformer = self.runtime.parallelize(model, config.parallel, cfg.activation_checkpoint,
                                                           mode=cfg.mode, graph_config=config.graph)
        apply_compile(self.model, config.compile, batch_invariant=config.numerics.batch_invariant)
        self.pipeline = self.runtime.pipeline  # None unless pp > 1: then self.model holds this rank's stages
        self.optimizer = config.optimizer.build(self.model)
        self.lr_at = config.lr_schedule.build(peak_lr=config.optimizer.lr, total_steps=config.steps)
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum  # global, all ranks
        # tokens_per_step counts every rank's tokens, so MFU is against every rank's peak.
        self.peak = {**peak_matmul_record(self.dtype, torch.get_num_threads()),
                     "ranks": self.runtime.world_size}
        self.timer = StageTimer()
        self.checkpointing = None
        self.start_step, self.resumed = 0, None
        if config.checkpoint.every or config.resume:
            from lockstep.train.checkpointing import build_checkpointing

            self.checkpointing = build_checkpointing(self)
            self.runtime.barrier()  # rank 0 has cleared interrupted saves before anyone writes
            if config.resume:
                self.resumed = self.checkpointing.resume()
                self.start_step = self.resumed["from_step"]
        self.manifest = self._manifest() if self.runtime.is_main else None

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
            **model_kernels(model),
        }

    def _manifest(self) -> RunManifest:
        info = self.model_info
        manifest = run_manifest(
            self.run_dir, self.config, model=info["model"], runtime=self.runtime, checkpoint=self.checkpointing,
            resumed=self.resumed,
            numerics_extra={"agreement": self.agreement, "changes_numerics": self.low_precision is not None,
                            "emulated": bool(self.low_precision and self.low_precision.emulated)},
            kernels={"attention": info["attention"], "moe_routing": info["moe_routing"],
                     **{k: info[k] for k in ("linear_attention",) if k in info},  # hybrid models
                     "compute_dtype": self.config.training.dtype, "autocast": self.dtype != torch.float32},
            peak_flops=self.peak,
            data={
                "dataset": self.config.data.dataset,
                "tokenizer_vocab": self.data.tokenizer.vocab_size,
                "train_tokens": self.data.train_tokens,
                "val_tokens": self.data.val_tokens,
            },
            transforms=list(self.config.transforms),
            low_precision=self.low_precision.manifest() if self.low_precision else None,
            graph=graph_manifest(self.runtime),
            init_from={"name": self.config.init_from, "path": str(self.init_path)} if self.init_path else None,
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

    def train_step(self, step: int, batches) -> dict[str, float]:
        """One optimizer step over ``grad_accum`` micro-batches; the step's scalars are reduced once."""
        cfg = self.config.training
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        scalars = self.runtime.scalars()
        for _ in range(cfg.grad_accum):
            with self.timer.stage("data"):
                batch = next(batches)
            scalars.add_loss(self.runtime.loss_and_backward(batch, cfg.grad_accum, self.timer),
                             divide_by=cfg.grad_accum)
        with self.timer.stage("optimizer"):
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
            grad_norm = self.runtime.clip_gradients(max_norm)
        out = scalars.reduce()  # the step's one host synchronisation, before the update
        record = {"loss": out.pop("loss"), "lr": lr, "grad_norm": float(grad_norm), **out}
        if self.runtime.graph is not None:  # graphs captured so far: a changed shape adds one
            record["graph/captures"] = self.runtime.graph.captures
            if self.runtime.graph.checks:  # graph.check_steps: micro-batches where graph != eager so far
                record["graph/check_diverged"] = sum(c is not None for c in self.runtime.graph.checks)
        bad = nonfinite_values(loss=record["loss"], grad_norm=record["grad_norm"])
        with self.timer.stage("optimizer"):
            if bad:  # never applied: the policy (``_fit``) decides what happens next
                self.runtime.drop_step(self.optimizer)
                record["nonfinite"] = bad
            else:
                self.runtime.apply_step(self.optimizer)
        return record

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``validation.batches`` batches and every data-parallel rank."""
        self.model.eval()
        scalars = self.runtime.scalars()
        limit = self.config.validation.batches or None
        n = 0
        for i, batch in enumerate(self.data.val.iter_epoch()):
            if limit is not None and i >= limit:
                break
            scalars.add_loss(self.runtime.loss(batch))
            n += 1
        self.model.train()
        return scalars.reduce().get("loss", 0.0) / max(n, 1)

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
        # rank 0 writes the run's metrics (+ TensorBoard, W&B); other ranks keep their own log beside it
        log = RunLog(self.run_dir, cfg.output, rank=self.runtime.rank, main=self.runtime.is_main,
                     resume_step=self.start_step if self.resumed else None, recipe=to_dict(cfg))
        val_losses.update({r["step"]: r["val_loss"] for r in log.kept if "val_loss" in r})
        bar = log.progress(last, cfg.recipe, cfg.output.progress)
        initial_val = self.evaluate() if cfg.validation.every and not self.resumed else None
        if initial_val is not None:
            val_losses[0] = initial_val
        with log:
            if initial_val is not None:
                log.write({"step": 0, "val_loss": initial_val})
            self.model.train()
            guard = NonFiniteGuard(cfg.training.on_nonfinite, max_rollbacks=cfg.training.max_rollbacks,
                                   rollback=(lambda: self.checkpointing.rollback(log)) if self.checkpointing else None)
            step = self.start_step
            while step < last:
                step += 1
                started = time.perf_counter()
                record = {"step": step, **self.train_step(step, batches)}
                if "nonfinite" in record:  # the update was dropped; stop raises here
                    restored = guard.handle(step, record.pop("nonfinite"), record)
                    if restored is not None:  # rolled back: redo the steps after that checkpoint
                        self.timer.pop()
                        log.write({**record, **guard.record(), "nonfinite/rollback_to": restored})
                        del losses[max(restored - self.start_step, 0):]
                        step = restored
                        continue
                record.update(guard.record())
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
                log.write(record)
                bar.update(step, loss=record["loss"], tokens_per_s=tokens_per_s)
                if self.checkpointing is not None:
                    if self.checkpointing.due(step, last):
                        self.checkpointing.save(step)
                    for ckpt in self.checkpointing.records(wait=step == last):
                        log.write({"step": step, **ckpt})
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
