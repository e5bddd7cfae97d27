"""Converted runs: the transforms, the refusals, and the dsv3-mtp-mxfp8 recipe training with its manifest."""

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import build_model
from lockstep.recipes import get_recipe
from lockstep.recipes.transforms import apply_transform
from lockstep.train.trainer import Trainer


def test_transforms_set_the_format():
    cfg = get_recipe("debug").config()
    assert apply_transform(cfg, "fp8").low_precision.format == "fp8_rowwise"
    assert apply_transform(cfg, "fp8=tensorwise").low_precision.format == "fp8_tensorwise"
    mx = apply_transform(cfg, "mxfp8")
    assert mx.low_precision.format == "mxfp8" and mx.transforms == ["mxfp8"]
    with pytest.raises(ConfigError, match=r"^--transform fp8=SCALING"):
        apply_transform(cfg, "fp8=blockwise")


def test_batch_invariant_mode_refuses_the_converters():
    cfg = apply_transform(get_recipe("debug").config(), "mxfp8")
    cfg.numerics.batch_invariant = True
    cfg.training.device = "cpu"
    with pytest.raises(ConfigError, match=r"^low_precision.format: 'mxfp8' cannot run with numerics.batch_invariant"):
        cfg.validate()


def test_bad_format_and_unsupported_layouts_are_refused():
    cfg = get_recipe("debug").config()
    cfg.low_precision.format = "fp4"
    with pytest.raises(ConfigError, match=r"^low_precision.format"):
        cfg.validate()
    cfg = apply_transform(get_recipe("debug-moe").config(), "fp8")
    cfg.parallel.ep = 2
    with pytest.raises(ConfigError, match=r"^low_precision.format: .*parallel.ep=2"):
        cfg.validate()


@pytest.fixture(scope="module")
def mxfp8_run(tmp_path_factory):
    cfg = get_recipe("dsv3-mtp-mxfp8").config()
    cfg = dataclasses.replace(cfg, steps=6, run_dir=str(tmp_path_factory.mktemp("mxfp8") / "run"))
    cfg.training = dataclasses.replace(cfg.training, batch_size=2, seq_len=32)  # 62 tokens: MX pads the rows
    cfg.validation = dataclasses.replace(cfg.validation, every=6, batches=1)
    cfg.lr_schedule = dataclasses.replace(cfg.lr_schedule, warmup_steps=1)
    cfg.output = dataclasses.replace(cfg.output, progress=False, sample_tokens=4, parity_check=False)
    return cfg, Trainer(cfg).fit()


def test_dsv3_mtp_mxfp8_recipe_trains(mxfp8_run):
    cfg, result = mxfp8_run
    assert len(result.losses) == 6 and all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0]
    assert result.val_losses[6] < result.val_losses[0]


def test_manifest_records_the_layers_and_the_emulation(mxfp8_run):
    cfg, result = mxfp8_run
    manifest = json.loads((result.run_dir / "manifest.json").read_text())
    lp = manifest["low_precision"]
    assert lp["format"] == "mxfp8" and lp["emulated"] and lp["numerics_changing"]
    assert lp["layers"]["layers.1.feed_forward.experts"] == "mxfp8"
    assert lp["layers"]["mtp.0.block.attention.wkv_a"] == "mxfp8"  # the recipe's shape aligns every projection
    assert set(lp["kept_high_precision"]) == {"output", "layers.1.feed_forward.gate",
                                              "layers.2.feed_forward.gate", "mtp.0.block.feed_forward.gate"}
    assert manifest["numerics"]["changes_numerics"] and manifest["numerics"]["emulated"]


def test_converted_weights_export_as_ordinary_weights(mxfp8_run):
    cfg, result = mxfp8_run
    saved = load_file(result.run_dir / "model.safetensors")
    plain = build_model(cfg.model, seed=0)
    assert set(saved) <= set(plain.state_dict()) and all(t.dtype == torch.float32 for t in saved.values())
    plain.load_state_dict(saved, strict=False)  # an unconverted model takes the converted run's weights
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 8))
    assert torch.isfinite(plain(tokens)).all()


def test_command_line_fields():
    from lockstep.cli import resolve_config

    cfg, _ = resolve_config(["--recipe", "debug", "--transform", "mxfp8", "--low-precision.exclude", "layers.0.*",
                             "*.wo", "--low-precision.min-elements", "0"])
    assert cfg.low_precision.format == "mxfp8" and cfg.low_precision.exclude == ["layers.0.*", "*.wo"]
    assert cfg.low_precision.min_elements == 0 and cfg.transforms == ["mxfp8"]


def test_a_converted_runs_checkpoint_resumes_unconverted(tmp_path):
    cfg = apply_transform(get_recipe("debug").config(), "fp8")
    cfg = dataclasses.replace(cfg, steps=4, run_dir=str(tmp_path / "run"))
    cfg.low_precision.min_elements = 0
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=2)
    cfg.validation = dataclasses.replace(cfg.validation, every=0)
    cfg.output = dataclasses.replace(cfg.output, progress=False, sample_tokens=0, parity_check=False)
    converted = Trainer(cfg).fit()
    plain = dataclasses.replace(get_recipe("debug").config(), steps=6, run_dir=cfg.run_dir, resume=True,
                                checkpoint=cfg.checkpoint, validation=cfg.validation, output=cfg.output)
    resumed = Trainer(plain)
    assert resumed.resumed["from_step"] == 4 and resumed.low_precision is None
    saved = load_file(converted.run_dir / "model.safetensors")
    for name, tensor in resumed.model.state_dict().items():  # the converted run's final weights, as they were
        assert torch.equal(tensor, saved[name]), name
    result = resumed.fit()
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
