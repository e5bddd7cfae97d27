"""``lockstep rl`` end to end on the rl-debug recipe: colocated in-process runs, and trainer +
generator processes under torchrun (gloo): metrics, on-policy batch-invariant agreement (exactly 0),
asynchronous rollouts with bounded lag, resume, and clear errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockstep import numerics
from lockstep.cli_rl import resolve_rl_config
from lockstep.config.base import ConfigError
from lockstep.observe import read_metrics
from lockstep.rl.loop import run_rl

STEP_METRICS = [
    "reward/mean", "reward/std", "pass_rate", "response_length/mean", "policy_lag/mean", "policy_lag/max",
    "generator/tokens_per_s", "trainer/tokens_per_s", "time/weight_sync", "time/generating", "time/training",
    "time/waiting", "time/step", "logprob_diff/max", "logprob_diff/mean", "logprob_diff/frac_tokens_different",
    "rollouts/stale_groups_dropped", "loss", "grad_norm",
]


def debug_config(tmp_path: Path, *flags: str):
    config, _ = resolve_rl_config(["--recipe", "rl-debug", "--run-dir", str(tmp_path / "run"), *flags])
    return config


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]


@pytest.fixture(autouse=True)
def _restore_numerics():
    yield
    numerics.set_batch_invariant(False)


def test_colocated_synchronous_step_end_to_end(tmp_path):
    config = debug_config(tmp_path, "--workers.generators", "0", "--steps", "2", "--task.eval-every", "2",
                          "--task.eval-tasks", "4")
    result = run_rl(config)
    records = step_records(result.run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for name in STEP_METRICS:
        assert all(name in r for r in records), name
    assert all(r["policy_lag/max"] == 0 and r["rollout_version"] == r["step"] - 1 for r in records)
    # echo gives every group reward variance: the policy gradient is not zero, the weights move
    assert all(r["grad_norm"] > 0 and r["reward/std"] > 0 for r in records)
    assert [e["step"] for e in result.evals] == [0, 2] and all(0 <= e["eval/pass_rate"] <= 1 for e in result.evals)
    for name in ("reward.png", "logprob_diff.png", "manifest.json", "model.safetensors", "tokenizer.json"):
        assert (result.run_dir / name).is_file(), name
    manifest = json.loads((result.run_dir / "manifest.json").read_text())
    assert manifest["workers"]["mode"] == "colocated" and manifest["result"]["steps"] == 2


def test_colocated_batch_invariant_logprobs_are_exact_and_off_they_are_not(tmp_path):
    on = run_rl(debug_config(tmp_path / "on", "--workers.generators", "0", "--numerics.batch-invariant"))
    diffs = [r["logprob_diff/max"] for r in step_records(on.run_dir)]
    assert diffs == [0.0] * len(diffs)
    manifest = json.loads((on.run_dir / "manifest.json").read_text())
    assert [c["passed"] for c in manifest["checks"] if c["name"] == "rl_batch_invariance"] == [True]
    numerics.set_batch_invariant(False)
    off = run_rl(debug_config(tmp_path / "off", "--workers.generators", "0"))
    off_records = step_records(off.run_dir)
    assert all("logprob_diff/max" in r for r in off_records)
    assert max(r["logprob_diff/max"] for r in off_records) > 0  # batched decode vs one full forward


def test_resume_continues_from_the_checkpoint_bitwise(tmp_path):
    flags = ["--workers.generators", "0", "--steps", "4", "--checkpoint.every", "1", "--checkpoint.mode", "sync"]
    straight = run_rl(debug_config(tmp_path / "a", *flags))
    run_rl(debug_config(tmp_path / "b", *flags, "--stop-after", "2"))
    resumed = run_rl(debug_config(tmp_path / "b", *flags, "--resume"))
    a, b = step_records(straight.run_dir), step_records(resumed.run_dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("loss", "reward/mean", "grad_norm", "policy_version"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa, wb = load_file(straight.run_dir / "model.safetensors"), load_file(resumed.run_dir / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    manifest = json.loads((resumed.run_dir / "manifest.json").read_text())
    assert manifest["resumed"]["from_step"] == 2 and manifest["resumed"]["policy_version"] == 2


def test_resume_refuses_a_changed_recipe(tmp_path):
    flags = ["--workers.generators", "0", "--steps", "2", "--checkpoint.every", "1", "--checkpoint.mode", "sync"]
    run_rl(debug_config(tmp_path, *flags, "--stop-after", "1"))
    with pytest.raises(ConfigError, match="loss.kind changed"):
        run_rl(debug_config(tmp_path, *flags, "--resume", "--loss.kind", "dapo"))


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "debug"], "is a training recipe"),
    (["--workers.generators", "0", "--workers.max-offpolicy-steps", "1"], "asynchronous rollouts need generator"),
    (["--loss.tis-cap", "2"], "ratio_to='current'"),
    (["--task.env", "nope"], "unknown environment"),
    (["--rollout.group-size", "1"], "group_size >= 2"),
    (["--task.eval-every", "1", "--task.eval-seed-offset", "2"], "overlap"),
    (["--steps", "0"], "steps: must be >= 1"),
    (["--parallel.tp", "2", "--workers.generators", "0"], "parallel.tp: colocated generation"),
    (["--parallel.dp-shard", "4", "--parallel.ep", "2"], "parallel.ep: the RL trainer's experts are split over ep"),
    (["--parallel.tp", "2", "--training.mode", "graph"], "training.mode: graph mode runs data-parallel"),
    (["--parallel.dp-shard", "-1"], "dp_shard must be given"),
    (["--parallel.dp-shard", "2", "--workers.generators", "0"], "colocated generation"),
    (["--parallel.dp-shard", "3"], "split evenly"),
])
def test_bad_rl_config_is_a_clear_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        resolve_rl_config(argv if argv[0] == "--recipe" else ["--recipe", "rl-debug", *argv])


def test_train_refuses_an_rl_recipe():
    from lockstep.cli import resolve_config

    with pytest.raises(ConfigError, match="lockstep rl --recipe rl-debug"):
        resolve_config(["--recipe", "rl-debug"])


def _cli(tmp_path: Path, *flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = ["rl", "--recipe", "rl-debug", "--run-dir", str(tmp_path / "run"), *flags]
    # the torchrun job `lockstep rl` relaunches itself into (world = trainer ranks + generators), started
    # directly: without the relaunching process's start-up; the relaunch itself: tests/rl/test_liveness.py
    world = resolve_rl_config(argv[1:])[0].world_size
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
    proc = subprocess.run([sys.executable, *launcher, "-m", "lockstep.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


#: one trainer rank + one generator, on-policy, batch-invariant, with a KL term and a checkpoint at step 2:
#: the on-policy test reads this run, and the FSDP trainer test compares its own layout with it
ONE_TRAINER = ["--steps", "3", "--numerics.batch-invariant", "--checkpoint.every", "2", "--loss.kl-coef", "0.05"]


@pytest.fixture
def one_trainer_run(computed_once) -> tuple[Path, str]:
    """(run dir, stdout) of ``ONE_TRAINER``, launched once per test run."""
    def make(root: Path) -> None:
        (root / "stdout.txt").write_text(_cli(root, *ONE_TRAINER).stdout)

    root = computed_once("rl one trainer + one generator", make)
    return root / "run", (root / "stdout.txt").read_text()


@pytest.mark.slow
def test_processes_on_policy_batch_invariant_logprob_diff_is_zero_every_step(one_trainer_run):
    run_dir, stdout = one_trainer_run
    records = step_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["logprob_diff/max"] for r in records] == [0.0, 0.0, 0.0]
    assert all(r["grad_norm"] > 0 for r in records)  # the weights changed, and the synced copy matched
    assert [r["rollout_version"] for r in records] == [0, 1, 2]
    assert all(r["weight_sync/bytes"] > 0 for r in records[:-1])
    assert all(name in records[0] for name in STEP_METRICS)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["workers"]["generator_ranks"] == [1] and manifest["workers"]["backend"] == "gloo"
    # trainer and generator use the same batch-invariant attention implementation (C kernel or fallback)
    assert manifest["generator_numerics"]["1"]["batch_invariant_attention"] == \
        manifest["numerics"]["batch_invariant_attention"]
    assert "logprob_diff/max over steps: 0" in stdout


@pytest.mark.slow
def test_processes_asynchronous_rollouts_lag_at_most_one(tmp_path):
    _cli(tmp_path, "--steps", "5", "--workers.max-offpolicy-steps", "1")
    records = step_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    lags = [r["policy_lag/max"] for r in records]
    assert all(lag <= 1 for lag in lags) and max(lags) == 1  # generation of batch i+1 overlapped step i
    assert sum(r["rollouts/stale_groups_dropped"] for r in records) == 0
    assert max(r["logprob_diff/max"] for r in records) > 0  # off-policy (and mode off): reported, nonzero


@pytest.mark.slow
def test_processes_two_generators(tmp_path):
    _cli(tmp_path, "--steps", "4", "--workers.generators", "2", "--workers.max-offpolicy-steps", "1")
    records = step_records(tmp_path / "run")
    assert [r["generator/rank"] for r in records] == [1, 2, 1, 2]
    assert all(r["policy_lag/max"] <= 1 for r in records)


def test_learner_drops_and_counts_over_stale_groups(tmp_path):
    from lockstep.rl.learner import EpisodeRecord, Learner
    from lockstep.rl.policy import load_policy

    config = debug_config(tmp_path, "--workers.generators", "1", "--workers.max-offpolicy-steps", "1")
    policy = load_policy(config)
    learner = Learner(config, policy.model)

    def record(group, sample, version, reward):
        ids = [5, 6, 7, 8 + sample]
        return EpisodeRecord(group=group, sample=sample, task_seed=group, task_id=f"t{group}", prompt_len=2,
                             token_ids=ids, loss_mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -1.0, -1.0],
                             reward=reward, policy_version=version, temperature=1.0, num_turns=1, truncated=None)

    # group 0 from version 3 (lag 1 at trainer version 4: kept), group 1 from version 2 (lag 2: dropped)
    records = [record(0, s, 3, float(s)) for s in range(4)] + [record(1, s, 2, float(s)) for s in range(4)]
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    out = learner.step(5, records, trainer_version=4)
    assert out["rollouts/stale_groups_dropped"] == 1 and out["groups_kept"] == 1
    assert out["policy_lag/max"] == 2 and out["loss/n_sequences"] == 4
    assert any(not torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
    # all groups stale: nothing counts, the loss is 0 and no gradient reaches the weights
    stale = [dataclasses.replace(r, policy_version=0) for r in records]
    out = learner.step(6, stale, trainer_version=5)
    assert out["rollouts/stale_groups_dropped"] == 2 and out["loss"] == 0.0 and out["grad_norm"] == 0.0


@pytest.mark.slow
def test_processes_fsdp_trainer_matches_one_trainer_process(tmp_path, one_trainer_run):
    """Trainer ranks 0-1 (FSDP2, dp_shard=2) + generator rank 2 vs trainer rank 0 + generator rank 1,
    batch-invariant so both generators sample the same tokens, with a KL term (the sharded trainer
    shards its frozen reference like the policy; checkpointed with it). Tolerance: the two layouts sum
    the gradient in a different order (reduce-scatter over 2 ranks), fp32 rounding ~1e-7 per step."""
    one_dir, _ = one_trainer_run
    _cli(tmp_path / "fsdp", *ONE_TRAINER, "--parallel.dp-shard", "2", timeout=400)
    one, fsdp = step_records(one_dir), step_records(tmp_path / "fsdp" / "run")
    assert [r["reward/mean"] for r in one] == [r["reward/mean"] for r in fsdp]
    assert [r["logprob_diff/max"] for r in fsdp] == [0.0, 0.0, 0.0]
    for a, b in zip(one, fsdp):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    wa = load_file(one_dir / "model.safetensors")
    wb = load_file(tmp_path / "fsdp" / "run" / "model.safetensors")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
    manifest = json.loads((tmp_path / "fsdp" / "run" / "manifest.json").read_text())
    assert manifest["workers"]["trainer_ranks"] == [0, 1] and manifest["workers"]["generator_ranks"] == [2]
    assert (tmp_path / "fsdp" / "run" / "checkpoints" / "step-00000002").is_dir()


def test_learner_raises_the_rewarded_response_and_lowers_the_other(tmp_path):
    """A group of two fixed responses, reward 1 for one and 0 for the other: each step must make the
    rewarded one more likely and the other less (the loss's sign and masking, end to end)."""
    from lockstep.rl.learner import EpisodeRecord, Learner
    from lockstep.rl.policy import load_policy
    from lockstep.rl.scoring import score_logprobs

    config = debug_config(tmp_path, "--workers.generators", "0", "--optimizer.lr", "1e-3")
    model = load_policy(config).model
    learner = Learner(config, model)
    prompt, good, bad = [5, 6, 7], [11, 12, 13], [21, 22, 23]

    def logp(response):
        with torch.no_grad():
            return score_logprobs(model, [prompt + response], [len(prompt)])[0]

    history = []
    for step in range(1, 4):
        history.append((float(logp(good).sum()), float(logp(bad).sum())))
        records = [EpisodeRecord(group=0, sample=s, task_seed=0, task_id="t", prompt_len=3,
                                 token_ids=prompt + (good if s % 2 == 0 else bad), loss_mask=[0, 0, 0, 1, 1, 1],
                                 logprobs=[0.0] * 3 + logp(good if s % 2 == 0 else bad).tolist(),
                                 reward=float(s % 2 == 0), policy_version=step - 1, temperature=1.0, num_turns=1,
                                 truncated=None) for s in range(4)]
        out = learner.step(step, records, trainer_version=step - 1)
        assert out["logprob_diff/max"] < 1e-5 and out["grad_norm"] > 0
    history.append((float(logp(good).sum()), float(logp(bad).sum())))
    assert all(b[0] > a[0] and b[1] < a[1] for a, b in zip(history, history[1:])), history


@pytest.mark.slow
def test_processes_resume_continues_with_the_saved_policy_version(tmp_path):
    flags = ["--steps", "3", "--checkpoint.every", "1", "--numerics.batch-invariant"]
    _cli(tmp_path, *flags, "--stop-after", "2")
    _cli(tmp_path, *flags, "--resume")
    records = step_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["rollout_version"] == 2 and records[-1]["logprob_diff/max"] == 0.0  # generators got v2
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["resumed"]["from_step"] == 2


def test_kl_reference_and_truncated_is_in_the_loop_and_in_the_checkpoint(tmp_path):
    flags = ["--workers.generators", "0", "--steps", "2", "--training.ratio-to", "current", "--loss.tis-cap", "2",
             "--loss.kl-coef", "0.05", "--checkpoint.every", "1", "--checkpoint.mode", "sync"]
    result = run_rl(debug_config(tmp_path, *flags))
    records = step_records(result.run_dir)
    assert all("loss/kl" in r and "loss/tis_weight_mean" in r for r in records)
    assert records[0]["loss/kl"] == 0.0 and records[1]["loss/kl"] > 0  # the policy left the reference
    assert all(0 < r["loss/tis_weight_mean"] <= 2 for r in records)
    index = json.loads(next((result.run_dir / "checkpoints").glob("step-*/index.json")).read_text())
    assert any(name.startswith("reference/") for name in index["tensors"])
