"""``lockstep train --recipe debug-gptoss``: a few steps run, the loss falls, the run's weights load back."""

import math

from lockstep.cli import resolve_config
from lockstep.models.hf import load_lockstep_dir
from lockstep.train.trainer import Trainer


def test_debug_gptoss_trains(tmp_path):
    cfg, _ = resolve_config(["--recipe", "debug-gptoss", "--steps", "3", "--run-dir", str(tmp_path / "run"),
                             "--output.no-progress", "--output.sample-tokens", "4"])
    result = Trainer(cfg).fit()
    assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0]
    model = load_lockstep_dir(result.run_dir)
    assert model.config.family == "gpt_oss" and model.layers["0"].attention.sinks is not None
