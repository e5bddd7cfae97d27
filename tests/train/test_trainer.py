"""Integration: the debug recipe trains, is bitwise deterministic, and writes a complete run dir."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from lockstep.config.base import ConfigError
from lockstep.parallel.checkpointing import ActivationCheckpointConfig
from lockstep.recipes import get_recipe
from lockstep.train.trainer import Trainer

pytestmark = pytest.mark.xdist_group("trainer")


def _debug(tmp_path, name="run", **changes):
    cfg = get_recipe("debug").config()
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / name), **changes)
    cfg.output = dataclasses.replace(cfg.output, progress=False)
    return cfg


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory):
    cfg = _debug(tmp_path_factory.mktemp("debug"))
    cfg.output = dataclasses.replace(cfg.output, parity_check=True)
    return Trainer(cfg).fit()


def test_debug_recipe_loss_falls(debug_run):
    losses = debug_run.losses
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 0.5
    assert debug_run.val_losses[20] < debug_run.val_losses[0]


def test_run_directory_has_every_file_and_key(debug_run):
    run = debug_run.run_dir
    for name in ("metrics.jsonl", "manifest.json", "loss.png", "model.safetensors", "tokenizer.json"):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    required = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "time/data", "time/forward",
                "time/backward", "time/optimizer", "peak_rss_bytes"}
    for r in steps:
        assert required <= set(r), required - set(r)
        assert 0 < r["mfu"] < 1 and r["tokens_per_s"] > 0
    manifest = json.loads((run / "manifest.json").read_text())
    for key in ("recipe", "model", "versions", "hardware", "checks", "kernels", "determinism", "peak_flops"):
        assert key in manifest, key
    assert manifest["recipe"]["recipe"] == "debug"
    assert manifest["model"]["parameters"] > 0 and manifest["model"]["flops_per_token"] > 0
    peak = manifest["peak_flops"]
    assert peak["ranks"] == 1 and peak["value"] == peak["per_thread"] * peak["cores_counted"]
    for r in steps:  # MFU is the logged throughput against the recorded peak, nothing else
        model_flops = r["tokens_per_s"] * manifest["model"]["flops_per_token"]
        assert r["mfu"] == pytest.approx(model_flops / (peak["value"] * peak["ranks"]), rel=1e-12)
    assert {"python", "torch", "lockstep"} <= set(manifest["versions"])
    assert manifest["kernels"]["attention"] == ["sdpa"]
    parity = [c for c in manifest["checks"] if c["name"] == "hf_parity"]
    assert len(parity) == 1 and parity[0]["passed"] is True, manifest["checks"]
    assert parity[0]["family"] == "llama3" and parity[0]["max_abs_diff"] <= 1e-4
    assert parity[0]["transformers"]
    weights = load_file(str(run / "model.safetensors"))
    assert "layers.0.attention.wq.weight" in weights


def test_same_recipe_and_seed_is_bitwise_deterministic(tmp_path, debug_run):
    steps = 8
    a = Trainer(_debug(tmp_path, "a", steps=steps)).fit()
    b = Trainer(_debug(tmp_path, "b", steps=steps)).fit()
    assert a.losses == b.losses  # float equality: bitwise
    wa = load_file(str(a.run_dir / "model.safetensors"))
    wb = load_file(str(b.run_dir / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    c = Trainer(_debug(tmp_path, "c", steps=steps, seed=1)).fit()
    assert c.losses != a.losses


def test_bf16_and_grad_accum_run(tmp_path):
    cfg = _debug(tmp_path, steps=4)
    cfg.training = dataclasses.replace(cfg.training, dtype="bfloat16", grad_accum=2)
    result = Trainer(cfg).fit()
    assert len(result.losses) == 4 and all(torch.isfinite(torch.tensor(result.losses)))


def test_refuses_to_overwrite_an_existing_run(tmp_path, debug_run):
    cfg = _debug(tmp_path)
    cfg = dataclasses.replace(cfg, run_dir=str(debug_run.run_dir))
    with pytest.raises(ConfigError, match="already holds a run"):
        Trainer(cfg)


def test_trainer_validates_before_work(tmp_path):
    cfg = _debug(tmp_path)
    cfg.training = dataclasses.replace(cfg.training, seq_len=100000)
    with pytest.raises(ConfigError, match="training.seq_len: must be <= model.max_seq_len"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_losses_bitwise(tmp_path, mode):
    base = Trainer(_debug(tmp_path, "none", steps=3)).fit()
    cfg = _debug(tmp_path, mode, steps=3)
    cfg.training = dataclasses.replace(cfg.training, activation_checkpoint=ActivationCheckpointConfig(mode=mode))
    result = Trainer(cfg).fit()
    assert result.losses == base.losses
    names = set(load_file(str(result.run_dir / "model.safetensors")))
    assert names == set(load_file(str(base.run_dir / "model.safetensors")))


def test_manifest_records_moe_routing_mode(tmp_path):
    from lockstep.cli import resolve_config

    cfg, _ = resolve_config(["--recipe", "debug-moe", "--steps", "2", "--run-dir", str(tmp_path / "moe"),
                             "--output.no-progress", "--output.sample-tokens", "0",
                             "--override", "layers.*.feed_forward=moe,routing=forced_balanced"])
    result = Trainer(cfg).fit()
    manifest = json.loads((result.run_dir / "manifest.json").read_text())
    assert manifest["kernels"]["moe_routing"] == ["forced_balanced"]
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    loads = [r["layers.0.feed_forward/load_cv"] for r in records if "loss" in r]
    assert loads and all(v == 0.0 for v in loads)  # forced balance: every expert gets the same load


def test_initial_weights_come_from_a_hf_directory(tmp_path):
    from lockstep.models.common.transformer import build_model
    from lockstep.models.hf import save_hf

    cfg = _debug(tmp_path, steps=1)
    source = build_model(cfg.model, seed=7)  # not the trainer's seed: equal weights must come from the dir
    save_hf(source, tmp_path / "hf")
    trainer = Trainer(dataclasses.replace(cfg, init_from=str(tmp_path / "hf")))
    loaded = dict(trainer.model.named_parameters())
    expected = dict(source.named_parameters())
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    random_init = dict(Trainer(_debug(tmp_path, "random", steps=1)).model.named_parameters())
    assert not all(torch.equal(random_init[k], expected[k]) for k in expected)


@pytest.mark.parametrize("device, message", [("cuda", "training.device: 'cuda' was asked for"),
                                             ("tpu", "training.device: must be one of")])
def test_device_field_is_checked_before_work(tmp_path, monkeypatch, device, message):
    from lockstep.cli import resolve_config
    from lockstep.cli_rl import resolve_rl_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=message):
        resolve_config(["--recipe", "debug", "--training.device", device])[0].validate()
    with pytest.raises(ConfigError, match=message):
        resolve_rl_config(["--recipe", "rl-debug", "--training.device", device])[0].validate()
    cfg, _ = resolve_config(["--recipe", "debug", "--training.device", "cpu", "--run-dir", str(tmp_path / "r")])
    cfg.validate()
    assert Trainer(cfg).runtime.device == torch.device("cpu")


def test_settings_the_training_mode_would_ignore_are_config_errors():
    from lockstep.config.base import ConfigError
    from lockstep.train.config import TrainerConfig

    config = TrainerConfig()
    config.graph.dump_dir = "dump"  # eager mode never captures a graph to dump
    with pytest.raises(ConfigError, match=r"graph.dump_dir: applies to training.mode=graph only"):
        config.validate()
    config = TrainerConfig()
    config.training.mode = "graph"
    config.compile.modules = ["layers.*"]  # the captured step is compiled by its own pass
    with pytest.raises(ConfigError, match=r"compile.modules: has no effect under training.mode=graph"):
        config.validate()
    config.compile.modules, config.graph.dump_dir = [], "dump"
    config.validate()


def test_graph_mode_refuses_layouts_it_cannot_capture_before_any_work():
    from lockstep.config.base import ConfigError
    from lockstep.train.config import TrainerConfig

    config = TrainerConfig()
    config.training.mode, config.parallel.tp = "graph", 2
    with pytest.raises(ConfigError, match=r"^training.mode: graph supports data parallelism .* parallel.tp=2"):
        config.validate()
    config.parallel.tp, config.training.activation_checkpoint.mode = 1, "selective"
    with pytest.raises(ConfigError, match=r"activation_checkpoint.mode: 'selective' is not supported"):
        config.validate()
