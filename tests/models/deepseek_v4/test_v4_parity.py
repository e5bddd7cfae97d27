"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM (tiny random, fp32, eager, no downloads):
logits at usual and unusual lengths, gradients of every parameter, HF files round trip, and the
release (flash) shape's parameter count.

Top-k (the CSA indexer) and hash/learned routing are discrete; both sides compute their scores with
the same fp32 op sequence so the choices agree, and the logits then agree to summation-order noise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
from v4_reference import hf_memory_state, pair, tiny_config  # noqa: E402

from lockstep.config.base import ConfigError  # noqa: E402
from lockstep.models.common.rope_yarn import YarnRopeConfig  # noqa: E402
from lockstep.models.common.transformer import build_meta_model  # noqa: E402
from lockstep.models.deepseek_v4 import FLAVORS, DeepSeekV4Adapter  # noqa: E402

#: fp32 logits of O(1) through 4 hyper-connected blocks: summation-order noise is ~1e-7
ATOL = 1e-5

LENGTHS = {
    "one_token": 1,            # no complete window: no compressed entries at all
    "below_window": 3,         # shorter than the CSA window (4)
    "exact_hca_window": 8,     # one HCA entry, two CSA entries, sliding window exactly full
    "odd_long": 37,            # 9 CSA entries > index_topk 4 (sparse), trailing partial windows
}


@pytest.fixture(scope="module")
def models():
    return pair()


@pytest.mark.parametrize("seq", LENGTHS.values(), ids=LENGTHS.keys())
def test_logits_match_transformers(models, seq):
    model, hf = models
    tokens = torch.randint(0, 4096, (2, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.abs().max() > 0.1  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_other_shapes_match_transformers():
    # other layer mix, 2 hyper-connection streams, two hash layers, top-1 indexer, rope as wide as the indexer head
    cfg = tiny_config(layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
                      mlp_layer_types=["hash_moe", "hash_moe", "moe"], n_layers=3, hc_mult=2, index_topk=1,
                      rope_dim=16, sliding_window=5, hca_rate=4, csa_rate=2, o_groups=4)
    model, hf = pair(cfg, seed=3)
    tokens = torch.randint(0, 4096, (3, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("attention_factor", [1.0, 0.0], ids=["released_factor_1", "derived_mscale"])
def test_yarn_compressed_rope_matches_transformers(attention_factor):
    # the released checkpoints' YaRN on the compressed branches (attention_factor 1), and YaRN's own mscale
    rope = YarnRopeConfig(theta=160000.0, scaling="yarn", factor=4.0, original_max_position_embeddings=16,
                          attention_factor=attention_factor)
    cfg = tiny_config(compress_rope=rope)
    adapter = DeepSeekV4Adapter()
    assert dataclasses.replace(adapter.config_from_hf(adapter.config_to_hf(cfg)), flavor="debug") == cfg
    model, hf = pair(cfg, seed=4)
    tokens = torch.randint(0, 4096, (2, 41), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=ATOL, rtol=0)


def test_gradients_match_transformers():
    model, hf = pair(seed=1)
    model.train(), hf.train()
    tokens = torch.randint(0, 4096, (2, 29), generator=torch.Generator().manual_seed(7))
    target = torch.randint(0, 4096, (2, 29), generator=torch.Generator().manual_seed(8))
    for logits in (model(tokens), hf(tokens).logits):
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ours = hf_memory_state(type("Grads", (), {"state_dict": lambda self: grads, "config": model.config})())
    theirs = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    # the same parameters get gradients; the indexer's (top-k choice only) gets none on either side
    assert set(ours) == set(theirs)
    assert not any(".indexer." in n for n in ours)
    checked = 0
    for name, grad in ours.items():
        ref = theirs[name]
        # fp32 gradients through 4 blocks: summation noise relative to the tensor's largest entry
        scale = max(ref.abs().max().item(), 1e-6)
        assert (grad - ref).abs().max().item() <= 1e-4 * scale + 1e-8, name
        checked += 1
    assert checked > 100


def test_hf_files_round_trip_bitwise(models, tmp_path):
    from transformers import DeepseekV4ForCausalLM

    from lockstep.models.hf import load_hf, save_hf

    model, hf = models
    hf.save_pretrained(tmp_path / "hf")  # transformers' on-disk layout (DeepSeek's names)
    first = load_hf(tmp_path / "hf", dtype=torch.float32, allow_unverified=True)
    save_hf(first, tmp_path / "ls")
    second = load_hf(tmp_path / "ls", dtype=torch.float32)
    a, b, ref = first.state_dict(), second.state_dict(), model.state_dict()
    assert a.keys() == b.keys() == ref.keys()
    for k in ref:
        assert torch.equal(a[k], ref[k]) and torch.equal(b[k], ref[k]), k
    assert first.config == second.config
    reloaded = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "ls", dtype=torch.float32).eval()
    tokens = torch.randint(0, 4096, (1, 23))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, model(tokens), atol=ATOL, rtol=0)


def test_in_memory_names_load_too(models):
    model, _ = models
    state = DeepSeekV4Adapter().state_from_hf(hf_memory_state(model), model.config)
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v), k


def test_flash_param_count_equals_transformers():
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = FLAVORS["flash"]()
    ours = build_meta_model(cfg).num_params()
    with torch.device("meta"):
        theirs = DeepseekV4ForCausalLM(DeepseekV4Config())  # transformers' defaults are the Flash shapes
    # lockstep keeps an (unused, zero) selection bias in hash-routed layers; transformers has none (a buffer, not a
    # parameter: num_params counts parameters only)
    assert ours == sum(p.numel() for p in theirs.parameters())
    assert 280e9 < ours < 300e9  # DeepSeek-V4-Flash: 284B parameters


def test_config_round_trip_and_refusals():
    adapter = DeepSeekV4Adapter()
    cfg = tiny_config()
    assert dataclasses.replace(adapter.config_from_hf(adapter.config_to_hf(cfg)), flavor="debug") == cfg
    yarn_main = {**adapter.config_to_hf(cfg)}
    yarn_main["rope_parameters"] = {**yarn_main["rope_parameters"], "main": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}}
    with pytest.raises(ConfigError, match=r"^config.json rope_parameters.main: rope_type 'yarn'"):
        adapter.config_from_hf(yarn_main)
    with pytest.raises(ConfigError, match=r"model.layer_types\[1\]"):
        tiny_config(layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                 "sliding_attention"]).validate()


def test_legacy_release_style_config_reads():
    """The released checkpoints' config.json style (per-layer compress_ratios, num_hash_layers, qk_rope_head_dim,
    rope_scaling YaRN) resolves through transformers' config to the same architecture fields."""
    hf = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=512, hidden_size=64,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8,
              q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8, compress_ratios=[128, 4, 0, 4],
              compress_rate_csa=4, compress_rate_hca=8, num_hash_layers=1, index_n_heads=4, index_head_dim=16,
              index_topk=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              rope_theta=10000, compress_rope_theta=160000, max_position_embeddings=1048576,
              rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                            "beta_fast": 32, "beta_slow": 1})
    cfg = DeepSeekV4Adapter().config_from_hf(hf)
    assert cfg.layer_types == ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                               "compressed_sparse_attention"]
    assert cfg.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"] and cfg.rope_dim == 8
    assert (cfg.compress_rope.scaling, cfg.compress_rope.factor, cfg.compress_rope.attention_factor) == ("yarn", 16, 1)
    assert (cfg.compress_rope.theta, cfg.main_rope.theta, cfg.main_rope.scaling) == (160000, 10000, "none")
