"""torchrun worker for the resharding tests: resume a run's checkpoint under this job's layout,
then save the loaded state again (this layout's shards) into another directory.

    torchrun --nproc-per-node N tests/checkpoint/reshard_worker.py OUT_DIR -- <lockstep train args>
"""

import sys

from lockstep.checkpoint import Checkpointer, LocalStorage
from lockstep.checkpoint.train_state import model_slots, optimizer_slots
from lockstep.cli import resolve_config
from lockstep.parallel.launch import finish
from lockstep.train.trainer import Trainer


def main() -> None:
    out_dir, train_args = sys.argv[1], sys.argv[3:]
    config, _ = resolve_config(train_args)
    trainer = Trainer(config)
    rank, world = trainer.runtime.rank, trainer.runtime.world_size
    ck = Checkpointer(LocalStorage(out_dir), rank=rank, world_size=world, mode="sync")
    slots = {**model_slots(trainer.model), **optimizer_slots(trainer.model, trainer.optimizer)}
    ck.save(trainer.start_step, slots, {"world_size": world}, {"world_size": world})
    trainer.checkpointing.close()
    finish(0)


if __name__ == "__main__":
    main()
