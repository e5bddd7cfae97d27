"""Logits and gradient parity with transformers' DeepseekV3ForCausalLM (tiny random, fp32, no downloads)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
import torch.nn.functional as F
from deepseek_hf_reference import DEFAULT_ROPE, YARN, hf_deepseek, lockstep_from_hf

from lockstep.models.common.transformer import build_model
from lockstep.models.deepseek_v3 import DeepSeekV3Adapter

ATOL = 1e-4

CASES = {
    # q compression on, YaRN (sequence longer than the original context), 1 dense + 2 MoE layers, 4 groups pick 2
    "qlora_yarn_grouped": dict(q_lora_rank=12, rope=YARN, n_group=4, topk_group=2),
    "noqlora_yarn_grouped": dict(q_lora_rank=None, rope=YARN, n_group=4, topk_group=2),
    # MLA alone: every layer dense (first_k_dense_replace = n_layers)
    "noqlora_yarn_all_dense": dict(q_lora_rank=None, rope=YARN, first_k_dense=3),
    # plain rope, half-rotation layout, 2 dense layers, no groups, tied embeddings, attention biases
    "qlora_plain_dense2_tied_bias": dict(q_lora_rank=12, rope=DEFAULT_ROPE, first_k_dense=2, n_group=1, topk_group=1,
                                         rope_interleave=False, tie=True, attention_bias=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case):
    hf, cfg = hf_deepseek(**CASES[case])
    model = lockstep_from_hf(hf, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        got = model(tokens)
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, f"{case}: max |lockstep - HF| = {diff:.3g}"
    assert want.abs().max() > 1.0  # the comparison is not between two near-zero tensors


def test_reference_backend_and_positions():
    """Override the attention kernel by glob (MLA sizes kept) and pass explicit positions."""
    from lockstep.config.components import parse_override

    hf, cfg = hf_deepseek()
    model = lockstep_from_hf(hf, cfg)
    ref_cfg = model.config.replace(overrides=[parse_override("layers.*.attention=mla,backend=reference",
                                                             [model.config.attention])])
    ref = build_model(ref_cfg)
    ref.load_state_dict(model.state_dict())
    ref.eval()
    assert {layer.attention.backend_name for layer in ref.layers.values()} == {"reference"}
    tokens = torch.randint(0, cfg.vocab_size, (1, 24))
    positions = torch.arange(5, 29)[None]
    with torch.no_grad():
        want = hf(tokens, position_ids=positions).logits
        got = ref(tokens, positions)
    assert (got - want).abs().max().item() <= ATOL


def _grads_by_lockstep_name(hf, adapter, cfg):
    grads = {n: p.grad for n, p in hf.named_parameters()}
    grads.update({n: torch.zeros_like(b) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")})
    return adapter.state_from_hf(grads, cfg)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_transformers(case):
    hf, cfg = hf_deepseek(**CASES[case])
    model = lockstep_from_hf(hf, cfg)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    hf.train()
    model.train()
    F.cross_entropy(hf(tokens).logits.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    want = _grads_by_lockstep_name(hf, DeepSeekV3Adapter(), model.config)
    got = {n: p.grad for n, p in model.named_parameters()}
    not_params = {k for k in want if k.endswith("e_score_correction_bias")}  # buffers
    if model.config.tie_embeddings:
        not_params.add("output.weight")  # the same Parameter as tok_embeddings.weight
    assert set(got) == set(want) - not_params
    for name, g in got.items():
        assert g is not None, name
        torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    attention_grads = [n for n in got if ".attention." in n]
    q_lora, bias = CASES[case]["q_lora_rank"], CASES[case].get("attention_bias", False)
    per_layer = (7 if q_lora else 5) + (bias and (3 if q_lora else 2))  # every MLA weight, norm and bias
    assert len(attention_grads) == cfg.num_hidden_layers * per_layer


def test_save_pretrained_files_round_trip(tmp_path):
    """Read what save_pretrained writes (per-expert tensors), and write files from_pretrained reads."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    hf, cfg = hf_deepseek()
    hf.save_pretrained(tmp_path / "hf")
    files = load_file(tmp_path / "hf" / "model.safetensors")
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in files)  # v5 reverts its fused experts on save
    adapter = DeepSeekV3Adapter()
    ls_cfg = adapter.config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    model = build_model(ls_cfg)
    model.load_state_dict(adapter.state_from_hf(files, ls_cfg), strict=True)
    model.eval()

    out_dir = tmp_path / "lockstep"
    out_dir.mkdir()
    written = adapter.state_to_hf(model.state_dict(), ls_cfg)
    assert set(written) == set(files)
    for k, v in written.items():
        assert torch.equal(v, files[k]), k
    save_file({k: v.contiguous() for k, v in written.items()}, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(adapter.config_to_hf(ls_cfg)))
    reloaded = DeepseekV3ForCausalLM.from_pretrained(out_dir, attn_implementation="eager").eval()
    assert adapter.config_from_hf(reloaded.config.to_dict()) == ls_cfg
    tokens = torch.randint(0, cfg.vocab_size, (2, 30))
    with torch.no_grad():
        want = hf(tokens).logits
        assert (reloaded(tokens).logits - want).abs().max().item() == 0.0
        assert (model(tokens) - want).abs().max().item() <= ATOL


def test_unknown_and_missing_tensors_are_named():
    hf, cfg = hf_deepseek()
    adapter = DeepSeekV3Adapter()
    ls_cfg = adapter.config_from_hf(cfg.to_dict())
    state = dict(hf.state_dict())
    with pytest.raises(ValueError, match="weight_scale_inv"):
        adapter.state_from_hf({**state, "model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(1)}, ls_cfg)
    state.pop("model.layers.1.mlp.experts.down_proj")
    with pytest.raises(ValueError, match=r"layers\.1\.feed_forward\.experts\.w2 lacks experts \[0, 1"):
        adapter.state_from_hf(state, ls_cfg)
