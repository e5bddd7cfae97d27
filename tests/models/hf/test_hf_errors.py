"""load_hf refuses what it cannot load exactly, with messages naming the file and the tensors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from lockstep.config.base import ConfigError
from lockstep.models.hf import load_hf, load_hf_config, load_lockstep_dir, save_lockstep_dir


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        config.pop(key)
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "config.json")) + ": missing"):
        load_hf(tmp_path)


def test_unknown_model_type(make_hf_dir):
    _, path = make_hf_dir("llama")
    _edit_config(path, model_type="gpt2")
    with pytest.raises(ConfigError) as err:
        load_hf(path, allow_unverified=True)
    message = str(err.value)
    assert str(path / "config.json") in message and "'gpt2'" in message
    assert "llama" in message and "qwen3" in message  # lists what is supported


def test_missing_tensor(make_hf_dir):
    _, path = make_hf_dir("llama")
    _edit_tensors(path, lambda t: [t.pop("model.layers.1.mlp.up_proj.weight"),
                                   t.pop("model.layers.0.self_attn.k_proj.weight")])
    with pytest.raises(ConfigError) as err:
        load_hf(path, allow_unverified=True)
    message = str(err.value)
    assert str(path / "model.safetensors") in message
    assert ("missing tensor(s) [model.layers.0.self_attn.k_proj.weight, "
            "model.layers.1.mlp.up_proj.weight]") in message


def test_untied_checkpoint_without_lm_head_is_missing_a_tensor(make_hf_dir):
    _, path = make_hf_dir("llama", tie_word_embeddings=False)
    _edit_tensors(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ConfigError, match=r"missing tensor\(s\) \[lm_head\.weight\]"):
        load_hf(path, allow_unverified=True)


def test_unexpected_tensor(make_hf_dir):
    _, path = make_hf_dir("llama")
    _edit_tensors(path, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16),
                                            "model.extra.bias": torch.zeros(3)}))
    with pytest.raises(ConfigError, match=re.escape(
            "unexpected tensor(s) [model.extra.bias, model.layers.0.self_attn.q_norm.weight]")):
        load_hf(path, allow_unverified=True)


def test_rotary_inv_freq_of_old_checkpoints_is_ignored(make_hf_dir, tokens):
    hf, path = make_hf_dir("llama")
    _edit_tensors(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    with torch.no_grad():
        assert torch.allclose(load_hf(path, allow_unverified=True)(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_shape_mismatch(make_hf_dir):
    _, path = make_hf_dir("llama", num_key_value_heads=2)
    _edit_config(path, num_key_value_heads=4)
    with pytest.raises(ConfigError) as err:
        load_hf(path, allow_unverified=True)
    message = str(err.value)
    assert str(path / "model.safetensors") in message
    assert "model.layers.0.self_attn.k_proj.weight (expected [64, 64], got [32, 64])" in message
    assert "model.layers.1.self_attn.v_proj.weight (expected [64, 64], got [32, 64])" in message


def test_tied_checkpoint_with_a_different_lm_head(make_hf_dir):
    _, path = make_hf_dir("llama", tie_word_embeddings=True)
    _edit_tensors(path, lambda t: t.update({"lm_head.weight": torch.zeros_like(t["model.embed_tokens.weight"])}))
    with pytest.raises(ConfigError, match="lm_head.weight differs"):
        load_hf(path, allow_unverified=True)


@pytest.mark.parametrize("field, value, needle", [
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}, "rope_parameters.rope_type='yarn'"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling.rope_type='linear'"),
    ("attention_bias", True, "attention_bias=True"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("quantization_config", {"quant_method": "bitsandbytes"}, "quantization_config"),
])
def test_unsupported_llama_features_name_the_field(make_hf_dir, field, value, needle):
    _, path = make_hf_dir("llama")
    _edit_config(path, **{field: value})
    with pytest.raises(ConfigError, match=re.escape(needle)) as err:
        load_hf_config(path)
    assert str(path / "config.json") in str(err.value)


def test_qwen3_sliding_window_is_refused(make_hf_dir):
    _, path = make_hf_dir("qwen3")
    _edit_config(path, use_sliding_window=True, sliding_window=16)
    with pytest.raises(ConfigError, match="use_sliding_window=True"):
        load_hf(path, allow_unverified=True)
    _edit_config(path, use_sliding_window=False, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ConfigError, match=r"layer_types=\['sliding_attention'\]"):
        load_hf(path, allow_unverified=True)


def test_no_weights_file(make_hf_dir):
    _, path = make_hf_dir("llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no model.safetensors or model.safetensors.index.json"):
        load_hf(path, allow_unverified=True)


def test_lockstep_dir_errors(make_hf_dir, tmp_path):
    with pytest.raises(ConfigError, match="neither lockstep_model.json nor manifest.json"):
        load_lockstep_dir(tmp_path)
    _, path = make_hf_dir("llama")
    save_lockstep_dir(load_hf(path, allow_unverified=True), tmp_path / "ls")
    _edit_tensors(tmp_path / "ls", lambda t: [t.pop("norm.weight"), t.update({"bogus": torch.ones(1)})])
    with pytest.raises(ConfigError, match=r"missing tensor\(s\) \[norm\.weight\]; unexpected tensor\(s\) \[bogus\]"):
        load_lockstep_dir(tmp_path / "ls")
