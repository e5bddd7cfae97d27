"""YaRN frequencies, attention factor and DeepSeek's softmax mscale against transformers 5.19."""

from __future__ import annotations

import math

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.rope_yarn import YarnRopeConfig, softmax_mscale_of, yarn_get_mscale

pytest.importorskip("transformers")

CASES = {
    # DeepSeek-V3 (rope dims 64)
    "deepseek_v3": dict(theta=10000.0, factor=40.0, original=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                        mscale_all_dim=1.0, dim=64, max_pos=163840),
    # Kimi-K2 (beta 1/1: a degenerate ramp, low == high after truncation)
    "kimi_k2": dict(theta=50000.0, factor=32.0, original=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                    mscale_all_dim=1.0, dim=64, max_pos=131072),
    # mscale != mscale_all_dim: the cos/sin attention factor is their ratio
    "mscale_ratio": dict(theta=10000.0, factor=16.0, original=2048, beta_fast=32.0, beta_slow=1.0, mscale=0.707,
                         mscale_all_dim=1.0, dim=32, max_pos=32768),
    # no mscales: attention factor 0.1 ln(factor) + 1, softmax unchanged; no truncation of the ramp
    "plain_untruncated": dict(theta=10000.0, factor=4.0, original=16, beta_fast=32.0, beta_slow=1.0, mscale=0.0,
                              mscale_all_dim=0.0, dim=8, max_pos=64, truncate=False),
}


def _hf(case):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": case["theta"], "factor": case["factor"],
              "original_max_position_embeddings": case["original"], "beta_fast": case["beta_fast"],
              "beta_slow": case["beta_slow"]}
    if case["mscale"]:
        params["mscale"] = case["mscale"]
    if case["mscale_all_dim"]:
        params["mscale_all_dim"] = case["mscale_all_dim"]
    if "truncate" in case:
        params["truncate"] = case["truncate"]
    cfg = DeepseekV3Config(qk_rope_head_dim=case["dim"], max_position_embeddings=case["max_pos"],
                           rope_parameters=params, num_hidden_layers=1)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    return inv_freq, attention_factor, cfg


def _ours(case) -> YarnRopeConfig:
    return YarnRopeConfig(theta=case["theta"], factor=case["factor"], original_max_position_embeddings=case["original"],
                          beta_fast=case["beta_fast"], beta_slow=case["beta_slow"], mscale=case["mscale"],
                          mscale_all_dim=case["mscale_all_dim"], truncate=case.get("truncate", True))


@pytest.mark.parametrize("name", list(CASES))
def test_inverse_frequencies_and_attention_factor_match_hf(name):
    case = CASES[name]
    want_inv, want_factor, _ = _hf(case)
    rope = _ours(case)
    rope.validate("rope")
    assert torch.equal(rope.inverse_frequencies(case["dim"]), want_inv)
    assert rope.cos_sin_factor() == pytest.approx(want_factor, rel=0, abs=1e-15)


@pytest.mark.parametrize("name", list(CASES))
def test_softmax_mscale_matches_hf_attention_scaling(name):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    case = CASES[name]
    _, _, cfg = _hf(case)
    assert _ours(case).softmax_mscale() == pytest.approx(yarn_apply_mscale(cfg.rope_parameters, 1.0), abs=1e-15)


def test_tables_match_hf_rotary_embedding():
    """cos/sin of every position equal transformers' DeepseekV3RotaryEmbedding (attention factor included)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    case = CASES["mscale_ratio"]
    _, _, cfg = _hf(case)
    table = _ours(case).build(head_dim=case["dim"], max_seq_len=4096)
    table.reset_parameters()
    positions = torch.arange(4096)[None]
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions)
    got_cos, got_sin = table(positions)
    torch.testing.assert_close(got_cos, cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_sin, sin, rtol=0, atol=2e-6)
    assert not torch.allclose(got_cos.abs().max(), torch.tensor(1.0))  # the attention factor is applied


def test_plain_and_llama3_scaling_still_work():
    from lockstep.models.common.rope import RopeConfig

    plain = YarnRopeConfig(scaling="none", theta=500000.0)
    assert torch.equal(plain.inverse_frequencies(16), RopeConfig(theta=500000.0).inverse_frequencies(16))
    assert plain.cos_sin_factor() == 1.0 and plain.softmax_mscale() == 1.0
    llama = YarnRopeConfig(scaling="llama3", theta=500000.0, factor=8.0, original_max_position_embeddings=8192)
    ref = RopeConfig(theta=500000.0, scaling="llama3", factor=8.0, original_max_position_embeddings=8192)
    assert torch.equal(llama.inverse_frequencies(64), ref.inverse_frequencies(64))
    assert softmax_mscale_of(ref) == 1.0


def test_mscale_and_validation():
    assert yarn_get_mscale(1.0, 5.0) == 1.0
    assert yarn_get_mscale(40.0, 1.0) == pytest.approx(0.1 * math.log(40.0) + 1.0)
    with pytest.raises(ConfigError, match="rope.scaling"):
        YarnRopeConfig(scaling="ntk").validate("rope")
    with pytest.raises(ConfigError, match="rope.factor"):
        YarnRopeConfig(factor=0.0).validate("rope")
