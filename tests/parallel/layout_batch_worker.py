"""Runs several ``lockstep train`` jobs one after another in the same processes (one torchrun job).

Used by ``test_loss_parity.py``: a launch's wall time is almost all process start-up (torch and
lockstep imported on every rank), so the layouts of one world size share one launch. Each job is
``lockstep.cli.main(["train", *argv])`` -- the CLI's own parsing and Trainer run -- with its own run
dir; the process group stays up between jobs (``init_distributed`` reuses it; each run builds its own
meshes and groups), and the process-global switches a run sets (batch-invariant kernels, compiled
regions) are put back to a fresh process's before each job.

Usage: ``python -m torch.distributed.run ... layout_batch_worker.py SPEC`` (or plain ``python`` for
one-process jobs). SPEC: JSON ``[{"dir": ..., "argv": [...]}, ...]``; every job's ``dir`` exists.
Each rank writes ``dir/rank{r}.log`` (its stdout and stderr during the job); on success rank 0 writes
``dir/ok`` after a barrier. A job that fails on a rank (nonzero exit code or exception) writes
``dir/error-rank{r}.txt`` and ends that process with exit code 1 (the other ranks may be inside a
collective: torchrun then stops them); the caller relaunches with the jobs after it.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def _run_job(argv: list[str], log: Path) -> tuple[int, str]:
    """(exit code, traceback or "") of ``lockstep train argv``, its fd 1 and 2 going to ``log``."""
    from lockstep import cli

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            code, error = cli.main(["train", *argv]), ""
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
            error = f"SystemExit({exit_.code!r})"
        except BaseException:  # noqa: BLE001 -- reported as this job's failure
            code, error = 1, traceback.format_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return code or 0, error


def main(spec_path: str) -> None:
    jobs = json.loads(Path(spec_path).read_text())
    import torch.distributed as dist

    from lockstep import numerics
    from lockstep.compile import local as compile_local
    from lockstep.parallel import launch

    real_finish = launch.finish
    # cmd_train ends its worker with finish() (destroy_process_group; os._exit): the batch's next
    # job needs this process and its group, so the batch ends them itself, after the last job
    launch.finish = lambda code=0: None
    rank, _, _ = launch.init_distributed()
    for job in jobs:
        out = Path(job["dir"])
        numerics.set_batch_invariant(False)  # a fresh process's settings
        compile_local.enable_regions([], "inductor")
        code, error = _run_job(job["argv"], out / f"rank{rank}.log")
        if code != 0:
            (out / f"error-rank{rank}.txt").write_text(f"exit code {code}\n{error}")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if dist.is_initialized():
            dist.barrier()
        if rank == 0:
            (out / "ok").touch()
    real_finish(0)


if __name__ == "__main__":
    main(sys.argv[1])
