"""transformers model -> save_pretrained -> load_hf gives the same logits and gradients (fp32)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from lockstep.config.base import ConfigError
from lockstep.models.common.rope import RopeConfig
from lockstep.models.hf import load_hf, load_hf_config
from lockstep.models.hf.dense import hf_to_lockstep_name
from lockstep.load import load_model

TOL = 1e-4

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    # GQA ratio n_heads / n_kv_heads = 1, 2, 4
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa2": ("llama", dict(num_key_value_heads=2)),
    "llama-gqa4": ("llama", dict(num_key_value_heads=1)),
    "llama-head_dim32": ("llama", dict(head_dim=32, num_key_value_heads=2)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied-theta": ("llama", dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1234.0})),
    "llama-rope-llama3": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "qwen3-qknorm-tied": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-qknorm-gqa4-untied": ("qwen3", dict(head_dim=16, num_key_value_heads=1, tie_word_embeddings=False,
                                               rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, make_hf_dir, tokens):
    kind, overrides = CASES[case]
    hf, path = make_hf_dir(kind, **overrides)
    model = load_hf(path, allow_unverified=True).eval()
    with torch.no_grad():
        expected, got = hf(tokens).logits, model(tokens)
    diff = _max_diff(expected, got)
    print(f"{case}: max |logits diff| = {diff:.3g} (|logits| max {expected.abs().max().item():.3g})")
    assert got.dtype == torch.float32
    assert diff <= TOL
    cfg = model.config
    assert cfg.tie_embeddings == bool(overrides.get("tie_word_embeddings", False))
    assert (model.output.weight is model.tok_embeddings.weight) == cfg.tie_embeddings
    assert cfg.attention.qk_norm == (kind == "qwen3")


def test_llama3_rope_scaling_is_applied_not_ignored(make_hf_dir, tokens):
    hf, path = make_hf_dir("llama", rope_parameters=LLAMA3_ROPE)
    cfg = load_hf_config(path)
    assert cfg.rope == RopeConfig(theta=500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=16)
    unscaled = load_hf(path, allow_unverified=True)
    unscaled.rope = RopeConfig(theta=500000.0).build(head_dim=16, max_seq_len=cfg.max_seq_len)
    unscaled.rope.reset_parameters()
    with torch.no_grad():
        assert _max_diff(hf(tokens).logits, unscaled(tokens)) > 1e-2  # the test can see scaling


def test_legacy_rope_scaling_and_rope_theta_fields(make_hf_dir, tokens):
    """Pre-transformers-5 config.json: top-level rope_theta plus rope_scaling with "type"."""
    hf, path = make_hf_dir("llama", rope_parameters=LLAMA3_ROPE)
    config = json.loads((path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params
    (path / "config.json").write_text(json.dumps(config))
    assert load_hf_config(path).rope.scaling == "llama3"
    assert load_hf_config(path).rope.theta == 500000.0
    with torch.no_grad():
        assert _max_diff(hf(tokens).logits, load_hf(path, allow_unverified=True)(tokens)) <= TOL


def test_sharded_checkpoint_loads(make_hf_dir, tokens):
    hf, path = make_hf_dir("qwen3", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    with torch.no_grad():
        assert _max_diff(hf(tokens).logits, load_hf(path, allow_unverified=True)(tokens)) <= TOL


def test_sdpa_transformers_matches_too(make_hf_dir, tokens):
    hf, path = make_hf_dir("llama", attn="sdpa")
    with torch.no_grad():
        assert _max_diff(hf(tokens).logits, load_hf(path, allow_unverified=True)(tokens)) <= TOL


def test_dtype_argument(make_hf_dir, tokens):
    _, path = make_hf_dir("llama")
    model = load_hf(path, allow_unverified=True, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope.cos.dtype == torch.float32  # tables are rebuilt, not cast
    assert model(tokens).dtype == torch.bfloat16


def test_gradients_match_transformers(make_hf_dir, tokens):
    hf, path = make_hf_dir("llama", num_key_value_heads=2)
    hf.train()
    model = load_hf(path, allow_unverified=True).train()

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    loss_of(hf(tokens).logits).backward()
    loss_of(model(tokens)).backward()
    ours = dict(model.named_parameters())
    checked = set()
    for hf_name, p in hf.named_parameters():
        name = hf_to_lockstep_name(hf_name)
        assert name in ours, hf_name
        torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        checked.add(name)
    assert checked == set(ours)
    worst = max(_max_diff(ours[hf_to_lockstep_name(n)].grad, p.grad) for n, p in hf.named_parameters())
    print(f"gradient parity: max |grad diff| = {worst:.3g} over {len(checked)} tensors")


def test_config_argument_may_change_only_what_keeps_the_function(make_hf_dir, tokens):
    hf, path = make_hf_dir("llama")
    cfg = load_hf_config(path)
    other = dataclasses.replace(cfg, max_seq_len=64, flavor="mine",
                                attention=dataclasses.replace(cfg.attention, backend="reference"))
    model = load_hf(path, allow_unverified=True, config=other)
    assert model.config.attention.backend == "reference" and model.rope.cos.shape[0] == 64
    with torch.no_grad():
        assert _max_diff(hf(tokens).logits, model(tokens)) <= TOL
    with pytest.raises(ConfigError, match=r"model\.rope\.theta: checkpoint has 10000\.0, run config has 5\.0"):
        load_hf(path, allow_unverified=True, config=dataclasses.replace(cfg, rope=RopeConfig(theta=5.0)))
    with pytest.raises(ConfigError, match=r"model\.norm_eps"):
        load_model(path, config=dataclasses.replace(cfg, norm_eps=1e-3), tokenizer=False, allow_unverified=True)
    assert _max_diff(load_model(path, config=other, tokenizer=False, allow_unverified=True).model(tokens), model(tokens)) == 0.0
