"""The RL trainer process: the loop that consumes rollouts, steps the policy and syncs weights.

Per step ``i``: get batch ``i`` (from generator ``(i - 1) % N``, or generated here between steps
when colocated) -> ``Learner.step`` -> broadcast weights version ``i`` to the generators -> write
one metrics record (reward, pass rate, lengths, policy lag, generator/trainer tokens/s, weight-sync
time, time generating / training / waiting, ``logprob_diff/*``) -> checkpoint when due. Held-out
evaluation (greedy, engine on the trainer's own modules) runs before the first step, every
``task.eval_every`` steps and after the last; its records carry ``eval/*``.

Rank 0 reaches the generators through a :class:`~lockstep.rl.fleet.Fleet`: every wait on one is watched
by the heartbeat channel, and a lost generator stops the run (a ``generator_lost`` record in
metrics.jsonl, the newest checkpoint intact, :class:`~lockstep.rl.liveness.PeerLost` raised) or, with
``liveness.on_generator_loss = "continue"``, is dropped (a ``generator_lost`` record) and the run goes on.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import torch.distributed as dist

from lockstep import numerics
from lockstep.config.base import to_dict
from lockstep.generate.engine import Engine
from lockstep.graph.step import graph_manifest
from lockstep.observe import ProgressBar, RunManifest, plot_series, read_metrics
from lockstep.rl.checkpointing import build_checkpointing
from lockstep.rl.config import RLConfig
from lockstep.rl.fleet import Fleet
from lockstep.rl.generator import rollout_batch_payload
from lockstep.rl.layout import RLLayout
from lockstep.rl.learner import Learner
from lockstep.rl.liveness import PeerLost
from lockstep.rl.policy import Policy
from lockstep.rl.rollout import Rollout
from lockstep.rl.sft import evaluate, sft_warmup
from lockstep.rl.tp_split import plan_tp_split
from lockstep.run import NonFiniteGuard, RunLog, agree_on_run_dir, save_weights
from lockstep.run.manifest import model_kernels, run_manifest


@dataclasses.dataclass
class RLResult:
    run_dir: Path
    #: one record per RL step (what metrics.jsonl holds for it)
    steps: list[dict]
    #: the evaluation records (step 0 = before RL)
    evals: list[dict]


class RLTrainer:
    """The trainer ranks of an RL job (rank 0 also receives rollouts, syncs weights, evaluates and
    writes the run directory), or the only process when colocated."""

    def __init__(self, config: RLConfig, run_config: RLConfig, policy: Policy, layout: RLLayout) -> None:
        self.config, self.run_config, self.policy, self.layout = config, run_config, policy, layout
        self.runtime = runtime = layout.runtime
        self.main = runtime.is_main
        self.distributed = layout.world_size > 1
        self.run_dir = agree_on_run_dir(config, main=self.main, group=runtime.group, distributed=runtime.distributed)
        numerics.prepare_model(policy.model)  # before FSDP: it changes module classes
        #: the row-parallel sums split to the generators' TP degree (batch-invariant mode; lockstep.rl.tp_split)
        self.tp_split = plan_tp_split(config, policy.model)
        self.tp_split.apply(policy.model, "trainer")  # before the shadow copy and the TP plan: both keep it
        if self.main and self.tp_split.note:
            print(f"lockstep rl: batch-invariant: {self.tp_split.note}", flush=True)
        # rank 0's unsharded copy: what generators receive and what evaluation generates with
        self.shadow = copy.deepcopy(policy.model) if runtime.distributed and self.main else policy.model
        reference = None
        if config.loss.kl_coef > 0 and runtime.distributed:  # copied before sharding: FSDP refuses deepcopy
            reference = runtime.shard_frozen(copy.deepcopy(policy.model), config.parallel)
        self.model = runtime.parallelize(policy.model, config.parallel,  # FSDP2/HSDP, TP, EP over the trainer ranks
                                         mode=config.training.mode)
        self.learner = Learner(run_config, self.model, runtime, reference=reference)
        self.env = run_config.task.build()
        self.engine = self.rollout = None
        if self.main:
            self.engine = Engine(self.shadow, policy.tokenizer, run_config.engine)
            self.rollout = Rollout(self.engine, run_config.rollout, tokenizer=policy.tokenizer,
                                   chat_template=policy.chat_template)
        self.checkpointing = None
        self.start, self.resumed = 0, None
        if config.checkpoint.every or config.resume:
            self.checkpointing = build_checkpointing(config, self.run_dir, self.learner, rank=runtime.rank,
                                                     world_size=runtime.world_size, group=runtime.group)
            if config.resume:
                self.resumed = self.checkpointing.resume()
                self.start = self.resumed["from_step"]
        self.last = config.stop_after or config.steps
        #: every trainer rank's sends of its slices to each generator rank (workers.weight_sync "reshard"; the
        #: plans are collective with the generators); None otherwise
        self.reshard = None
        if layout.n_generators and config.workers.resolved_weight_sync(layout.dp) == "reshard":
            from lockstep.rl.weight_sync import GroupSenders

            self.reshard = GroupSenders(self.model, layout)
        #: rank 0's generators (weights out, rollouts in, liveness); None on other ranks and colocated
        self.fleet = Fleet(config, layout, self.shadow, self.reshard) if self.main and layout.n_generators else None
        #: each generator's numerics settings (threads, batch-invariant attention implementation)
        self.generator_numerics: dict[int, dict] = {}

    def _refresh_shadow(self) -> None:
        """Bring rank 0's unsharded copy up to the sharded weights (collective over trainer ranks)."""
        if self.runtime.distributed:
            state = self.runtime.full_state_dict(self.model)
            if self.main:
                self.shadow.load_state_dict(state)

    # ------------------------------------------------------------------ set-up records

    def _manifest(self) -> RunManifest:
        cfg, model = self.config, self.shadow
        n = cfg.workers.generators
        return run_manifest(
            self.run_dir, cfg, runtime=self.runtime, checkpoint=self.checkpointing, resumed=self.resumed,
            model={"family": cfg.model.family, "flavor": cfg.model.flavor, "parameters": model.num_params(),
                   "source": self.policy.source},
            kernels=model_kernels(model), numerics_extra={"tp_split": self.tp_split.describe()},
            graph=graph_manifest(self.runtime),  # training.mode and, in graph mode, the passes
            workers={"trainer_ranks": list(range(self.layout.dp)),
                     "trainer_layout": {"dp_replicate": cfg.parallel.dp_replicate, "dp_shard": cfg.parallel.dp_shard,
                                        "tp": cfg.parallel.tp, "ep": cfg.parallel.ep, "pp": cfg.parallel.pp,
                                        "fsdp": cfg.trainer_dp > 1},
                     "generator_ranks": [self.layout.generator_rank(g) for g in range(n)],
                     "mode": "colocated" if n == 0 else "separate processes (torchrun, torch.distributed)",
                     "backend": dist.get_backend() if dist.is_initialized() else None,
                     "max_offpolicy_steps": cfg.workers.max_offpolicy_steps,
                     "generator_parallel": to_dict(cfg.workers.generator_parallel),
                     "weight_sync": ("shared modules" if not n else "each trainer rank sends each generator rank its "
                                     "slices (resharding)" if self.reshard is not None else
                                     "one broadcast of a flat byte buffer per version")},
            environment={"name": cfg.task.env, "options": cfg.task.options},
        )

    # ------------------------------------------------------------------ the loop

    def _batch(self, step: int) -> tuple[dict, float]:
        """Step ``step``'s rollouts (on every trainer rank) and the seconds waited for them."""
        started = time.perf_counter()
        payload = None
        if self.main and not self.layout.n_generators:
            payload = rollout_batch_payload(self.rollout, self.env, self.run_config, step, step - 1)
        elif self.main:
            payload = self.fleet.receive(step)
        waited = time.perf_counter() - started if self.layout.n_generators else 0.0
        if self.layout.dp > 1:
            box = [payload]
            dist.broadcast_object_list(box, src=0, group=self.layout.trainer_group)
            payload = box[0]
        return payload, waited

    def _evaluate(self, step: int) -> dict:
        started = time.perf_counter()
        out = evaluate(self.engine, self.env, self.run_config, self.config.task.eval_seeds(),
                       tokenizer=self.policy.tokenizer, chat_template=self.policy.chat_template)
        return {"step": step, **out, "time/eval": time.perf_counter() - started}

    def run(self) -> RLResult | None:
        """The loop on every trainer rank; rank 0 returns the result, the others None. Raises PeerLost
        (rank 0) when a lost generator stops the run."""
        try:
            return self._run()
        except PeerLost:
            raise  # the generators were told
        except BaseException as err:
            if self.fleet is not None:  # the generators leave instead of waiting for this process
                self.fleet.live.stop_all(f"the trainer stopped: {type(err).__name__}")
            raise

    def _phase(self, text: str) -> None:
        if self.fleet is not None:
            self.fleet.live.phase(text)

    def _run(self) -> RLResult | None:
        cfg = self.config
        manifest = self._manifest() if self.main else None
        writer = RunLog(self.run_dir, cfg.output, rank=self.layout.rank, main=self.main,
                        resume_step=self.start if self.resumed else None, recipe=to_dict(cfg))
        steps, evals = [], []
        evaluating = bool(cfg.task.eval_every) and self.main
        with writer:
            if self.start == 0 and cfg.sft.steps:
                if evaluating:
                    self._phase("evaluating before the SFT warm-up")
                    evals.append(writer.write({**self._evaluate(0), "phase": "before_sft"}))
                self._phase("the SFT warm-up")
                sft_warmup(self.model, self.env, self.run_config, tokenizer=self.policy.tokenizer,
                           chat_template=self.policy.chat_template, eos_id=self.policy.eos_id,
                           log=lambda r: writer.write({"step": 0, "phase": "sft", **r}), runtime=self.runtime)
            self._refresh_shadow()
            if evaluating and self.start == 0:
                self._phase("evaluating before RL")
                evals.append(writer.write({**self._evaluate(0), "phase": "before_rl"}))
            if self.fleet is not None:
                self.fleet.start(self.start, self.last)
                if self.last > self.start:
                    self.fleet.send_weights(self.start)  # version `start`: the generators' first weights
            elif self.reshard is not None and self.last > self.start:
                self.reshard.send(self.start)
            bar = writer.progress(self.last, cfg.recipe, cfg.output.progress)
            step_started = time.perf_counter()
            guard = NonFiniteGuard(cfg.training.on_nonfinite, max_rollbacks=cfg.training.max_rollbacks,
                                   # the step count and policy version go on after a rollback (generators'
                                   # versions only increase); the restored weights go out with this step's sync
                                   rollback=(lambda: self.checkpointing.rollback(writer)) if self.checkpointing
                                   else None)
            done, logged = self.start, 0
            try:
                for step in range(self.start + 1, self.last + 1):
                    if self.fleet is not None:
                        self.fleet.check()
                    payload, waited = self._batch(step)
                    self._phase(f"training step {step}")
                    record = {"step": step, **self.learner.step(step, payload["records"], trainer_version=step - 1)}
                    if "nonfinite" in record:  # the update was dropped; stop raises here
                        restored = guard.handle(step, record.pop("nonfinite"), record)
                        if restored is not None:
                            record["nonfinite/rollback_to"] = restored
                    record.update(guard.record())
                    if self.reshard is None or step == self.last or (  # resharding: the copy only evaluates, saves
                            cfg.task.eval_every and (step % cfg.task.eval_every == 0 or step == cfg.steps)):
                        self._refresh_shadow()
                    sync = self.fleet.send_weights(step) if self.fleet is not None and step < self.last else {}
                    if self.fleet is None and self.reshard is not None and step < self.last:
                        self.reshard.send(step)
                    now = time.perf_counter()
                    record.update({
                        "policy_version": step, "rollout_version": payload["version"],
                        "generator/tokens": payload["generated_tokens"],
                        "generator/tokens_per_s": payload["generator/tokens_per_s"],
                        "time/generating": payload["generate_s"], "time/waiting": waited,
                        "time/weight_sync": sync.get("weight_sync/s", 0.0), **sync,
                        "time/step": now - step_started,
                        **{k: v for k, v in payload.items() if k.startswith("generator/") and k not in record},
                    })
                    step_started = now
                    if "numerics" in payload:
                        self.generator_numerics[payload["generator/rank"]] = payload["numerics"]
                    logged = self._write_fleet_events(writer, logged)
                    steps.append(writer.write(record))
                    done = step
                    if self.main:
                        self._print_samples(step, payload["records"], bar)
                    bar.update(step, reward=record["reward/mean"], pass_rate=record["pass_rate"])
                    if evaluating and (step % cfg.task.eval_every == 0 or step == cfg.steps):
                        self._phase(f"evaluating after step {step}")
                        evals.append(writer.write(self._evaluate(step)))
                    if self.checkpointing is not None:
                        if self.checkpointing.due(step, self.last):
                            self._phase(f"checkpointing step {step}")
                            self.checkpointing.save(step)
                        for ckpt in self.checkpointing.records(wait=step == self.last):
                            writer.write({"step": step, **ckpt})
                if self.fleet is not None:
                    self.fleet.finish()
                    self._write_fleet_events(writer, logged)
                elif self.reshard is not None:
                    self.reshard.close()
            except PeerLost as lost:
                self._stop(lost, writer, bar, done, logged)
                raise
            bar.close()
        if self.checkpointing is not None:
            self.checkpointing.close()
        if not self.main:
            return None
        self._finish(manifest, steps, evals)
        return RLResult(self.run_dir, steps, evals)

    def _write_fleet_events(self, writer: RunLog, logged: int) -> int:
        """Write the generator-lost records not written yet; returns how many are written now."""
        events = self.fleet.events if self.fleet is not None else []
        for event in events[logged:]:
            writer.write(event)
        return len(events)

    def _stop(self, lost: PeerLost, writer: RunLog, bar: ProgressBar, done: int, logged: int) -> None:
        """A lost generator stops the run: the in-flight save finishes (the newest checkpoint is the last
        one saved), one ``generator_lost`` record, the generators are told; ``lost.outcome`` says where
        to resume."""
        bar.close()
        self._write_fleet_events(writer, logged)
        newest, failure = None, ""
        if self.checkpointing is not None:
            try:
                for ckpt in self.checkpointing.records(wait=True):
                    writer.write({"step": done, **ckpt})
                self.checkpointing.close()
            except Exception as err:  # noqa: BLE001 -- the loss is what stops the run; say this too
                failure = f" (the last save failed: {err})"
            newest = self.checkpointing.checkpointer.latest_step()
        writer.write({"step": done, "event": "generator_lost", "generator_lost/rank": lost.rank,
                      "generator_lost/kind": lost.loss.kind, "generator_lost/phase": lost.loss.phase,
                      "generator_lost/action": "stop", "checkpoint/newest": newest, "message": str(lost)})
        self.fleet.live.stop_all(f"generator rank {lost.rank} was lost")
        lost.outcome = (f"lockstep rl: run stopped after step {done}; newest checkpoint: "
                        + (f"step {newest} (continue with --resume --run-dir {self.run_dir})" if newest is not None
                           else "none") + failure)

    def _print_samples(self, step: int, records: list, bar: ProgressBar) -> None:
        for r in records[: self.config.output.print_samples]:
            line = f"[step {step}] {r.task_id} reward={r.reward:.2f}: {r.last_text[:200]!r}"
            bar.write(line) if bar.enabled else print(line, flush=True)

    def _finish(self, manifest: RunManifest, steps: list[dict], evals: list[dict]) -> None:
        records = read_metrics(self.run_dir / "metrics.jsonl")
        plot_series(_reward_plot_records(records), ["reward/mean", "pass_rate", "pass_rate (10-step mean)",
                                                    "eval/pass_rate"], self.run_dir / "reward.png",
                    f"{self.config.recipe}: reward and pass rate", ylabel="reward / pass rate")
        # the generator (lockstep's engine or vLLM) vs the trainer, per step: 0 where batch-invariant mode holds
        plot_series([r for r in records if "logprob_diff/max" in r], ["logprob_diff/max", "logprob_diff/mean"],
                    self.run_dir / "logprob_diff.png", f"{self.config.recipe}: generator vs trainer log-probabilities",
                    ylabel="|generator - trainer| log-probability")
        if self.config.output.save_weights:
            save_weights(self.shadow.state_dict(), self.run_dir / "model.safetensors", self.config.model.tie_embeddings)
            self.policy.tokenizer.save(self.run_dir / "tokenizer.json") if hasattr(self.policy.tokenizer, "save") \
                else None
        all_steps = [r for r in records if "reward/mean" in r]
        diffs = [r["logprob_diff/max"] for r in all_steps]
        result = {
            "steps": len(all_steps),
            "reward_first": all_steps[0]["reward/mean"] if all_steps else None,
            "reward_last": all_steps[-1]["reward/mean"] if all_steps else None,
            "eval": [{k: r[k] for k in ("step", "eval/pass_rate", "eval/reward_mean")} for r in records
                     if "eval/pass_rate" in r],
            "logprob_diff_max_over_steps": max(diffs) if diffs else None,
            "policy_lag_max": max((r["policy_lag/max"] for r in all_steps), default=None),
            "stale_groups_dropped": sum(r["rollouts/stale_groups_dropped"] for r in all_steps),
        }
        manifest.update(result=result, generator_numerics={str(k): v for k, v in self.generator_numerics.items()})
        if numerics.is_batch_invariant() and self.config.workers.max_offpolicy_steps == 0 and diffs:
            manifest.add_check("rl_batch_invariance", max(diffs) == 0.0,
                               logprob_diff_max=max(diffs), steps=len(diffs),
                               note="generator logprobs vs trainer logprobs of the same weights, every step")


def _reward_plot_records(records: list[dict], window: int = 10) -> list[dict]:
    """Step records with a trailing mean of the pass rate, and the evaluations after SFT (the one
    before SFT would sit at step 0 beside the one before RL)."""
    steps = [r for r in records if "pass_rate" in r]
    out = []
    for i, r in enumerate(steps):
        recent = [s["pass_rate"] for s in steps[max(0, i + 1 - window): i + 1]]
        out.append({**r, "pass_rate (10-step mean)": sum(recent) / len(recent)})
    return out + [r for r in records if "eval/pass_rate" in r and r.get("phase") != "before_sft"]
