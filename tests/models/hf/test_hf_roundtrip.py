"""lockstep -> save_hf -> transformers (and back), lockstep directories, `lockstep convert`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lockstep.config.base import ConfigError, to_dict
from lockstep.config.overrides import ComponentOverride
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.rope import RopeConfig
from lockstep.models.common.transformer import build_model
from lockstep.models.hf import (
    config_from_dict,
    load_hf,
    load_hf_config,
    load_lockstep_dir,
    save_hf,
    save_lockstep_dir,
)
from lockstep.models.hf.convert import cmd_convert, parse_size
from lockstep.models.registry import model_config
from lockstep.run.directory import save_weights

import transformers
TOL = 1e-4


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _lockstep_model(family: str, seed: int = 0, **changes):
    cfg = dataclasses.replace(model_config(family, "debug"), vocab_size=256, max_seq_len=128, **changes)
    model = build_model(cfg, seed=seed)
    with torch.no_grad():  # non-trivial norm scales so a swapped norm would show
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.mul_(5.0)
    return model.eval()


ROUND_TRIP = {
    "llama3-debug": ("llama3", {}),
    "llama3-rope-scaled": ("llama3", dict(rope=RopeConfig(theta=500000.0, scaling="llama3", factor=8.0,
                                                          original_max_position_embeddings=16))),
    "llama3-tied": ("llama3", dict(tie_embeddings=True)),
    "qwen3-debug-tied": ("qwen3", {}),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP))
def test_save_hf_loads_in_transformers_with_same_logits(case, tmp_path):
    family, changes = ROUND_TRIP[case]
    model = _lockstep_model(family, **changes)
    save_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = _max_diff(model(tokens), hf(tokens).logits)
    print(f"{case}: lockstep -> save_hf -> transformers max |logits diff| = {diff:.3g}")
    assert diff <= TOL
    assert hf.config.tie_word_embeddings == model.config.tie_embeddings
    # ... and back into lockstep, architecture and weights unchanged
    back = load_hf(tmp_path / "hf")
    assert dataclasses.replace(back.config, flavor=model.config.flavor, init_std=model.config.init_std) \
        == dataclasses.replace(model.config, head_dim=back.config.head_dim)
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_save_hf_shards_with_index(tmp_path):
    model = _lockstep_model("llama3")
    save_hf(model, tmp_path / "hf", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "hf" / "model.safetensors").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert _max_diff(model(tokens), hf(tokens).logits) <= TOL
        assert _max_diff(model(tokens), load_hf(tmp_path / "hf")(tokens)) == 0.0
    # Saving again unsharded removes the stale shards and index.
    save_hf(model, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]


def test_save_hf_refuses_what_transformers_cannot_express(tmp_path):
    model = _lockstep_model("llama3", attention=AttentionConfig(qkv_bias=True))
    with pytest.raises(ConfigError, match="qkv_bias"):
        save_hf(model, tmp_path / "hf")
    model = _lockstep_model("qwen3", overrides=[ComponentOverride(pattern="layers.1.attention",
                                                                  config=AttentionConfig(qk_norm=False))])
    with pytest.raises(ConfigError, match=r"layers\.1\.attention\.qk_norm"):
        save_hf(model, tmp_path / "hf")


def test_backend_override_survives_save_hf(tmp_path):
    model = _lockstep_model("llama3", overrides=[ComponentOverride(
        pattern="layers.*.attention", config=AttentionConfig(backend="reference"))])
    save_hf(model, tmp_path / "hf")  # only the kernel differs: representable
    assert load_hf_config(tmp_path / "hf").attention.backend == "sdpa"


def test_config_from_dict_round_trips_flavors_and_overrides():
    for family in ("llama3", "qwen3"):
        for flavor in ("debug", "8B"):
            cfg = model_config(family, flavor)
            assert config_from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg
    cfg = dataclasses.replace(model_config("qwen3", "debug"), overrides=[ComponentOverride(
        pattern="layers.0.attention", config=AttentionConfig(backend="reference", qk_norm=True))])
    again = config_from_dict(json.loads(json.dumps(to_dict(cfg))))
    assert again == cfg and type(again.overrides[0].config) is AttentionConfig
    with pytest.raises(ConfigError, match=r"model\.rope: RopeConfig has no field\(s\) \['bogus'\]"):
        config_from_dict({**to_dict(cfg), "rope": {"_type": "RopeConfig", "bogus": 1}})
    with pytest.raises(ConfigError, match="unknown config class 'NoSuchNorm'"):
        config_from_dict({**to_dict(cfg), "norm": {"_type": "NoSuchNorm"}})


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_lockstep_dir_round_trip(family, tmp_path):
    model = _lockstep_model(family)
    save_lockstep_dir(model, tmp_path / "ls")
    back = load_lockstep_dir(tmp_path / "ls")
    assert back.config == model.config
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.equal(back(tokens), model(tokens))
    assert (back.output.weight is back.tok_embeddings.weight) == model.config.tie_embeddings


def test_training_run_dir_reads_and_converts(tmp_path):
    """A trainer run dir: manifest.json holds the config; save_weights kept one name of the tie."""
    model = _lockstep_model("qwen3")  # tied
    run = tmp_path / "run"
    run.mkdir()
    save_weights(model.state_dict(), run / "model.safetensors", tied=True)
    (run / "manifest.json").write_text(json.dumps({"recipe": {"model": to_dict(model.config)}}))
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.equal(load_lockstep_dir(run)(tokens), model(tokens))
    assert cmd_convert(["--to-hf", str(run), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert _max_diff(hf(tokens).logits, model(tokens)) <= TOL


def test_cmd_convert_both_ways(make_hf_dir, tmp_path, tokens):
    hf, src = make_hf_dir("llama", num_key_value_heads=1)
    (src / "tokenizer.json").write_text("{}")  # copied verbatim, not parsed on --from-hf
    assert cmd_convert(["--from-hf", str(src), "--allow-unverified-weights", "--out", str(tmp_path / "ls")]) == 0
    assert {p.name for p in (tmp_path / "ls").iterdir()} == {"model.safetensors", "lockstep_model.json",
                                                            "tokenizer.json"}
    ls = load_lockstep_dir(tmp_path / "ls")
    (tmp_path / "ls" / "tokenizer.json").unlink()
    assert cmd_convert(["--to-hf", str(tmp_path / "ls"), "--out", str(tmp_path / "hf"),
                        "--max-shard-size", "30KB"]) == 0
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        assert _max_diff(hf(tokens).logits, ls(tokens)) <= TOL
        assert _max_diff(hf(tokens).logits, back(tokens).logits) <= TOL
    assert cmd_convert(["--from-hf", str(src), "--allow-unverified-weights", "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert load_lockstep_dir(tmp_path / "bf16").tok_embeddings.weight.dtype == torch.bfloat16


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("100") == 100
    with pytest.raises(ConfigError, match="max-shard-size"):
        parse_size("lots")
