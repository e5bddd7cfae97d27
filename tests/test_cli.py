"""The command line: recipes list, --print-config, field flags, transforms, overrides, errors."""

import json
import subprocess
import sys

import pytest

from lockstep.cli import main, resolve_config
from lockstep.config.base import ConfigError


def test_recipes_lists_names_and_descriptions(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "debug" in out and "shakespeare" in out and "tiny llama3" in out
    assert "seq_len" in out  # transforms are listed too


def test_field_flags_short_flags_and_print_config(capsys):
    assert main(["train", "--recipe", "debug", "--steps", "7", "--seed", "3", "--run-dir", "x",
                 "--optimizer.lr", "0.01", "--model.rope.theta", "1234", "--print-config"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["steps"] == 7 and tree["seed"] == 3 and tree["run_dir"] == "x"
    assert tree["optimizer"]["lr"] == 0.01 and tree["model"]["rope"]["theta"] == 1234.0


def test_underscore_field_names_are_accepted():
    cfg, _ = resolve_config(["--recipe", "debug", "--training.batch_size", "3"])
    assert cfg.training.batch_size == 3


def test_transforms_apply_in_order_and_are_recorded():
    cfg, _ = resolve_config(["--recipe", "debug", "--transform", "seq_len=128", "--transform", "bf16",
                             "--transform", "flavor=tiny"])
    assert cfg.training.seq_len == 128 and cfg.training.dtype == "bfloat16"
    assert cfg.model.flavor == "tiny" and cfg.model.vocab_size == 4096
    assert cfg.transforms == ["seq_len=128", "bf16", "flavor=tiny"]


def test_override_from_the_command_line():
    cfg, _ = resolve_config(["--recipe", "debug", "--override", "layers.0.attention=attention,backend=reference"])
    slots = cfg.model.slots()
    assert slots["layers.0.attention"].backend == "reference"
    assert slots["layers.1.attention"].backend == "sdpa"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recipe", "nope"], "unknown recipe 'nope'"),
        (["--recipe", "debug", "--optimizer.lr", "-1"], "optimizer.lr: must be > 0"),
        (["--recipe", "debug", "--training.seq-len", "0"], "training.seq_len: must be > 0"),
        (["--recipe", "debug", "--model.n-heads", "3"], "model.n_heads: must divide dim=64"),
        (["--recipe", "debug", "--optimizer.lrr", "1"], "unknown flag.*--optimizer.lrr"),
        (["--recipe", "debug", "--transform", "warp"], "unknown transform 'warp'"),
        (["--recipe", "debug", "--override", "layers.9.attention=attention"], "matches no module"),
        (["--recipe", "debug", "--override", "layers.*.attention=attention",
          "--override", "layers.0.attention=attention"], "both replace module 'layers.0.attention'"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config(argv)


def test_console_script_reports_config_errors_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "train", "--recipe", "debug",
                           "--optimizer.lr", "-1"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "config error: optimizer.lr: must be > 0" in proc.stderr
    assert "Traceback" not in proc.stderr
