"""A ParallelRuntime over a subset of the world (an RL job's trainer ranks beside its generators):
every process takes part in creating it, the others get None, and the runtime's reductions and mesh
(HSDP's flattened data dim included) span its ranks only. World 3 (gloo): ranks 0-1 + rank 2."""

from __future__ import annotations

import datetime
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.runtime import ParallelRuntime


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    runtime = ParallelRuntime.create(ParallelConfig(dp_replicate=2, dp_shard=1), ranks=range(2), device="cpu")
    out: dict = {"member": runtime is not None}
    if runtime is not None:
        scalars = runtime.scalars()
        scalars.add({"x": torch.tensor(float(rank + 1))})
        out.update(main=runtime.is_main, world=runtime.world_size, dp_rank=runtime.dp_rank,
                   dp_mesh=runtime.mesh["dp"].size(), mean=scalars.reduce()["x"])
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.slow
def test_runtime_over_a_subset_of_the_world(tmp_path):
    mp.spawn(_worker, args=(3, str(tmp_path / "init"), str(tmp_path)), nprocs=3, join=True)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert out[2] == {"member": False}  # the generator rank
    assert [o["dp_rank"] for o in out[:2]] == [0, 1] and [o["main"] for o in out[:2]] == [True, False]
    assert all(o["world"] == 2 and o["dp_mesh"] == 2 for o in out[:2])
    assert [o["mean"] for o in out[:2]] == [1.5, 1.5]  # (1 + 2) / 2: the generator's rank takes no part
