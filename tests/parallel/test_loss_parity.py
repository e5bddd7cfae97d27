"""Loss parity: each parallel layout (torchrun, gloo) trains like one process from the same weights.

5 fp32 steps of a debug recipe. Tolerance 1e-5 absolute on the loss: the layouts change reduction
order (sharded grads reduce-scattered, TP partial sums all-reduced, different thread counts), which
moves fp32 losses of ~8 by a few 1e-7 per step; a wrong gradient moves them by >1e-3 (measured:
an untied-by-accident embedding under TP differed by 7e-3 at step 2).

Layouts in ``PARAMS_CHECKED`` also compare every saved parameter after the 5 steps: within 2e-4
absolute. AdamW's normalised step turns the ~1e-7 relative gradient noise of a reordered reduction
into parameter differences, largest on embedding rows of rare tokens whose gradients are tiny
(measured: 1e-5 for the tp=2 layouts, 4e-5 for deepseek at dp_shard=2, 8e-5 at tp=2 x ep=2); a
missing gradient reduction moves parameters by ~lr = 3e-3 per step (measured: MLA under tp=2 without
the shared rotary key's gradient sum, 1.5e-2 on ``wkv_a``, while its losses moved 2e-4).

The runs are batched (layout_batch_worker.py): the layouts of one world size run one after another
in one torchrun job, each as ``lockstep train`` would run it (its CLI, its own run dir), and the
one-process references in one process; a launch is almost all start-up (torch + lockstep imported on
every rank), so this saves one start-up per layout (measured: this file at ``pytest -n 2`` on the
loaded 2-vCPU machine, 702 s with a launch per layout and per reference, 199-201 s batched). A layout
whose run fails fails its own test with its ranks' output; the layouts after it run in a new launch.
``test_batched_run_equals_a_standalone_launch`` checks that a batch leaks nothing from one run into the next.

Layouts on image+text rows also compare the gradient norm of each step within 5e-4: a sharded
(DTensor) norm differs from one process's by up to 9e-5 on these debug models (measured: tp=2 qwen3,
dp_shard=2 llama3, tp=2 qwen3_vl), while the tower's gradient left unsummed over tp moved it by 4e-2 at
step 1 and counted twice (summed over tp once more) by 0.32 (tp=2 qwen3_vl).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.parallel.tested_layouts import PARAMS_CHECKED, TESTED_LAYOUTS, degree_flags, trains_on_images
from lockstep.recipes import get_recipe

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]

COMMON = ["--steps", "5", "--validation.every", "0", "--output.no-progress", "--output.sample-tokens", "0"]
WORKER = Path(__file__).with_name("layout_batch_worker.py")
LAYOUTS = [(test_id, recipe, world, degree_flags(degrees), flags)
           for test_id, recipe, world, degrees, flags in TESTED_LAYOUTS]
# not a TESTED_LAYOUTS entry (see test_qwen35_moe_tp2_matches_one_process): runs in the world-2 batch
QWEN35_MOE_TP2 = ("qwen3_5 moe tp=2", "debug-qwen35-moe", 2, ["--parallel.tp", "2"], [])
#: (recipe, model flags) of every one-process reference
REFERENCES = sorted({(recipe, tuple(flags)) for _, recipe, _, _, flags in LAYOUTS} | {("debug-qwen35-moe", ())})


def _argv(run_dir, recipe, extra, save_weights):
    argv = ["--recipe", recipe, "--run-dir", str(run_dir), *COMMON, *extra]
    return argv if save_weights else [*argv, "--output.no-save-weights"]


def _run_batch(root: Path, nproc: int, jobs: list[tuple[str, list[str]]]) -> None:
    """Run ``lockstep train`` jobs ``(name, argv)`` (run dir ``root/name/run``) in one job of ``nproc``
    processes (layout_batch_worker.py: the start-up paid once, not per job). A job that fails ends the
    job's processes; the jobs after it run in a new one. Job ``name`` succeeded iff ``root/name/ok``;
    else ``_failure(root / name)`` says why."""
    for name, _ in jobs:
        (root / name).mkdir()
    todo = list(jobs)
    while todo:
        spec = root / f"spec-{len(jobs) - len(todo)}.json"
        spec.write_text(json.dumps([{"dir": str(root / name), "argv": argv} for name, argv in todo]))
        cmd = [sys.executable, str(WORKER), str(spec)]
        if nproc > 1:  # the torchrun job `lockstep train --nproc N` starts (launch.relaunch_with_torchrun)
            cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        # the whole batch's time: start-up, then each job (5 steps of a debug model; a world of 8 on
        # 2 vCPUs is the slowest, so the allowance grows with the world size)
        timeout = 60 + 20 * len(todo) * max(1, nproc // 2)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            output += f"\n[batch of {len(todo)} job(s) killed after {timeout} s]"
        while todo and (root / todo[0][0] / "ok").exists():
            todo.pop(0)
        if todo:  # the job running when the batch ended: it failed (or hung); the rest go on
            (root / todo.pop(0)[0] / "batch-output.txt").write_text(
                f"exit code {proc.returncode}\n{output[-6000:]}")


def _failure(job_dir: Path) -> str:
    """What a failed batch job left: each rank's error and output tail, the batch's output tail."""
    parts = []
    for path in sorted(job_dir.glob("error-rank*.txt")) + sorted(job_dir.glob("rank*.log")) + \
            sorted(job_dir.glob("batch-output.txt")):
        parts.append(f"--- {path.name}\n{path.read_text()[-3000:]}")
    return "\n".join(parts) or "no output (the batch never reached this job)"


@pytest.fixture(scope="module")
def batch(computed_once):
    """``get(name, nproc) -> (loss records, run dir)`` of a multi-rank job run in its world size's batch:
    every LAYOUTS entry (and QWEN35_MOE_TP2) of that world size, run once per test run (the xdist
    workers share them); fails with the job's own errors when it failed."""

    def get(name, nproc):
        # job key: the entry's index, its run dir <batch dir>/<key>/run
        jobs = {str(i): (test_id, recipe, degrees + flags, test_id in PARAMS_CHECKED | {QWEN35_MOE_TP2[0]})
                for i, (test_id, recipe, world, degrees, flags) in enumerate([*LAYOUTS, QWEN35_MOE_TP2])
                if world == nproc}
        root = computed_once(f"loss-parity batch world={nproc}", lambda d: _run_batch(d, nproc, [
            (key, _argv(d / key / "run", recipe, extra, save)) for key, (_, recipe, extra, save) in jobs.items()]))
        key = next(key for key, job in jobs.items() if job[0] == name)
        if not (root / key / "ok").exists():
            pytest.fail(f"{name}: its run in the world-{nproc} batch failed\n{_failure(root / key)}")
        return _loss_records(root / key / "run"), root / key / "run"

    return get


def _loss_records(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]


@pytest.fixture(scope="module")
def reference(computed_once):
    """One-process (losses, run dir with model.safetensors) per (recipe, model flags): all of
    REFERENCES run in one process once per test run (the xdist workers share them)."""

    def get(recipe, model_flags=()):
        root = computed_once("loss-parity references", lambda d: _run_batch(
            d, 1, [(str(i), _argv(d / str(i) / "run", r, list(f), True)) for i, (r, f) in enumerate(REFERENCES)]))
        key = str(REFERENCES.index((recipe, tuple(model_flags))))
        if not (root / key / "ok").exists():
            pytest.fail(f"the one-process reference {recipe} {model_flags} failed\n{_failure(root / key)}")
        return _loss_records(root / key / "run"), root / key / "run"

    return get


@pytest.mark.parametrize("name, recipe, nproc, degrees, flags", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_layout_matches_one_process(batch, reference, name, recipe, nproc, degrees, flags):
    check_params = name in PARAMS_CHECKED
    images = trains_on_images(get_recipe(recipe).config())
    records, run_dir = batch(name, nproc)
    losses = [r["loss"] for r in records]
    ref_records, ref_dir = reference(recipe, flags)  # flags are model flags: the reference uses them too
    expected = [r["loss"] for r in ref_records]
    assert [r["step"] for r in records] == [r["step"] for r in ref_records] == [1, 2, 3, 4, 5]
    assert len(losses) == len(expected) == 5
    diffs = [abs(a - b) for a, b in zip(losses, expected)]
    assert max(diffs) <= 1e-5, (name, losses, expected)
    for got_r, want_r in zip(records, ref_records):  # auxiliary losses (MoE balance, MTP) too
        aux = sorted(k for k in want_r if k.startswith("aux_loss/"))
        assert aux == sorted(k for k in got_r if k.startswith("aux_loss/")), (name, got_r.keys())
        assert all(abs(got_r[k] - want_r[k]) <= 1e-5 for k in aux), (name, got_r, want_r)
        if images:  # the replicated tower's gradient counted once (parallel/visual.py), seen by clipping too
            assert abs(got_r["grad_norm"] - want_r["grad_norm"]) <= 5e-4, (name, got_r, want_r)
    if check_params:
        from safetensors.torch import load_file

        got, want = load_file(run_dir / "model.safetensors"), load_file(ref_dir / "model.safetensors")
        assert got.keys() == want.keys()
        worst = max(((got[k] - want[k]).abs().max().item(), k) for k in want)
        assert worst[0] <= 2e-4, (name, worst)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["parallel"]["world_size"] == nproc
    assert manifest["parallel"]["parity_test"].endswith(f"[{name}]")  # the manifest names this test
    assert (run_dir / "logs" / f"rank{nproc - 1}.jsonl").is_file()  # per-rank logs
    if "moe" in recipe or "deepseek" in recipe:  # the step seam reports MoE metrics on every layout
        for r in records:
            assert r["layers.1.feed_forward/load_cv"] >= 0 and r["layers.1.feed_forward/load_max"] > 0, r


def test_qwen35_moe_tp2_matches_one_process(batch, reference):
    """Tensor parallel over the Qwen3.5 MoE hybrid (tp=2): Gated DeltaNet with the split projections
    (``in_proj_qkv`` and the conv held whole, computing each rank's heads' rows), output-gated
    attention, expert TP and the sigmoid-gated shared expert; losses and every parameter.

    Not a ``TESTED_LAYOUTS`` entry: a run's manifest names its parity test by family and degrees, and
    the dense qwen3_5 entry ``tp=2 qwen3_5 (Gated DeltaNet, gated attention)`` already holds those.
    Its one-process reference is the ``ep=2 x dp_shard=2 qwen3_5 moe`` entry's (the module fixture)."""
    from safetensors.torch import load_file

    one, one_dir = reference("debug-qwen35-moe")
    two, two_dir = batch(QWEN35_MOE_TP2[0], 2)
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4, 5]
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
    got, want = load_file(two_dir / "model.safetensors"), load_file(one_dir / "model.safetensors")
    assert got.keys() == want.keys()
    assert any(".shared_expert_gate." in k for k in want) and any(".in_proj_qkv." in k for k in want)
    worst = max(((got[k] - want[k]).abs().max().item(), k) for k in want)
    assert worst[0] <= 2e-4, worst


def test_batched_run_equals_a_standalone_launch(tmp_path, batch):
    """A batch leaks nothing from one run into the next (process-global switches, RNG, caches, the
    reused process group): its last world-2 run, after every other world-2 layout in the same
    processes, has the losses and parameters of the same run launched on its own, bitwise."""
    import torch
    from safetensors.torch import load_file

    batched, batched_dir = batch(QWEN35_MOE_TP2[0], 2)
    _, recipe, nproc, degrees, flags = QWEN35_MOE_TP2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "lockstep.cli", "train", *_argv(tmp_path / "run", recipe, degrees + flags, save_weights=True)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    alone = _loss_records(tmp_path / "run")
    assert [r["loss"] for r in batched] == [r["loss"] for r in alone] and len(alone) == 5
    got, want = load_file(batched_dir / "model.safetensors"), load_file(tmp_path / "run" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
