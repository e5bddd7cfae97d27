"""Logits, top-k selection and gradient parity with transformers' DeepseekV32ForCausalLM, and the HF
files round trip (tiny random, fp32, no downloads).

Top-k is discrete: both sides compute the index scores with the same fp32 op sequence, so the
selection agrees exactly (asserted directly below); logits then agree to fp32 summation noise."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
import torch.nn.functional as F
from v32_reference import DEFAULT_ROPE, hf_v32, lockstep_from_hf

from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import build_model
from lockstep.models.deepseek_v32 import DeepSeekV32Adapter

#: fp32 logits of O(5) through 3 blocks: summation-order noise is ~1e-6
ATOL = 1e-4

CASES = {
    # 5 keys per query out of 37 (batch 2), YaRN, 1 dense + 2 MoE layers, grouped routing
    "topk5_yarn": dict(kw=dict(index_topk=5), seq=37),
    # top-k larger than the sequence: every causal key is kept (dense attention)
    "topk_over_seq": dict(kw=dict(index_topk=100), seq=23),
    # one key per query; odd length
    "topk1": dict(kw=dict(index_topk=1), seq=13),
    # plain rope, tied embeddings, attention biases, 2 dense layers, an indexer head as wide as the rope dims
    "plain_tied_bias_rope_wide_index": dict(kw=dict(index_topk=7, rope=DEFAULT_ROPE, tie=True, attention_bias=True,
                                                    first_k_dense=2, n_group=1, topk_group=1, index_head_dim=4),
                                            seq=29),
    # transformers' SDPA path (boolean masks) instead of eager (additive masks)
    "sdpa_reference": dict(kw=dict(index_topk=6, attn="sdpa"), seq=31),
}


def _tokens(vocab: int, seq: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case):
    hf, cfg = hf_v32(**CASES[case]["kw"])
    model = lockstep_from_hf(hf, cfg)
    tokens = _tokens(cfg.vocab_size, CASES[case]["seq"])
    with torch.no_grad():
        want = hf(tokens).logits
        got = model(tokens)
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, f"{case}: max |lockstep - HF| = {diff:.3g}"
    assert want.abs().max() > 1.0  # not two near-zero tensors


def test_sparse_selection_changes_the_model():
    """The top-k matters at these shapes: the same weights with top-k >= T give other logits."""
    hf, cfg = hf_v32(index_topk=5)
    sparse = lockstep_from_hf(hf, cfg)
    dense_hf, dense_cfg = hf_v32(index_topk=64)
    dense = lockstep_from_hf(dense_hf, dense_cfg)
    tokens = _tokens(cfg.vocab_size, 37)
    with torch.no_grad():
        assert (sparse(tokens) - dense(tokens)).abs().max() > 1e-2
        assert (sparse(tokens[:, :5]) - dense(tokens[:, :5])).abs().max() <= ATOL  # T <= top-k: same


@pytest.mark.parametrize("seq", [1, 6, 19])
def test_selected_keys_equal_transformers(seq):
    """Every layer's kept keys (causal and top-k) are transformers' indexer indices, exactly."""
    hf, cfg = hf_v32(index_topk=6)
    model = lockstep_from_hf(hf, cfg)
    theirs, ours = {}, {}
    hooks = [layer.self_attn.indexer.register_forward_hook(
        lambda m, args, out, i=i: theirs.__setitem__(i, out)) for i, layer in enumerate(hf.model.layers)]
    hooks += [block.attention.indexer.register_forward_hook(
        lambda m, args, out, i=int(name): ours.__setitem__(i, out[0])) for name, block in model.layers.items()]
    tokens = _tokens(cfg.vocab_size, seq)
    with torch.no_grad():
        hf(tokens)
        model(tokens)
    for h in hooks:
        h.remove()
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for i in range(cfg.num_hidden_layers):
        want = torch.zeros(2, seq, seq, dtype=torch.bool).scatter_(-1, theirs[i].long(), True) & causal
        assert torch.equal(ours[i][:, 0], want), f"layer {i}"
        assert int(want.sum(-1).max()) == min(6, seq)


def _grads_by_lockstep_name(hf, adapter, cfg):
    grads = {n: p.grad for n, p in hf.named_parameters()}
    grads.update({n: torch.zeros_like(b) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")})
    return adapter.state_from_hf(grads, cfg)


@pytest.mark.parametrize("case", ["topk5_yarn", "plain_tied_bias_rope_wide_index"])
def test_gradients_match_transformers(case):
    """Every parameter's gradient of the LM loss; the indexer gets none on either side (transformers
    runs it under no_grad; lockstep detaches its input and trains it only on its own KL loss)."""
    hf, cfg = hf_v32(**CASES[case]["kw"])
    model = lockstep_from_hf(hf, cfg)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 27), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2, 27), generator=gen)
    hf.train()
    model.train()
    F.cross_entropy(hf(tokens).logits.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    indexer = {n for n in got if ".indexer." in n}
    assert len(indexer) == 5 * cfg.num_hidden_layers
    assert all(got[n] is None for n in indexer)
    assert all(p.grad is None for n, p in hf.named_parameters() if ".indexer." in n)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for n, p in hf.named_parameters():
        if ".indexer." in n:
            hf_grads[n] = torch.zeros_like(p)  # state_from_hf wants every tensor
    hf_grads.update({n: torch.zeros_like(b) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")})
    want = DeepSeekV32Adapter().state_from_hf(hf_grads, model.config)
    for name, g in got.items():
        if name in indexer:
            continue
        assert g is not None, name
        torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_save_pretrained_files_round_trip(tmp_path):
    """Read what save_pretrained writes, write files from_pretrained reads: tensors bitwise, logits equal."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV32ForCausalLM

    hf, cfg = hf_v32()
    hf.save_pretrained(tmp_path / "hf")
    files = load_file(tmp_path / "hf" / "model.safetensors")
    assert any(".self_attn.indexer.k_norm.bias" in k for k in files)
    adapter = DeepSeekV32Adapter()
    ls_cfg = adapter.config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert ls_cfg.family == "deepseek_v32" and ls_cfg.attention.indexer.topk == 5
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
    reloaded = DeepseekV32ForCausalLM.from_pretrained(out_dir, attn_implementation="eager").eval()
    assert adapter.config_from_hf(reloaded.config.to_dict()) == ls_cfg
    tokens = _tokens(cfg.vocab_size, 30)
    with torch.no_grad():
        want = hf(tokens).logits
        assert torch.equal(reloaded(tokens).logits, want)
        assert (model(tokens) - want).abs().max().item() <= ATOL


def test_load_save_load_is_bitwise(tmp_path):
    """lockstep's load_hf -> save_hf -> load_hf: every tensor and the config identical."""
    from lockstep.models.hf import load_hf, save_hf

    hf, cfg = hf_v32(index_topk=3)
    hf.save_pretrained(tmp_path / "a")
    first = load_hf(tmp_path / "a", dtype=torch.float32, allow_unverified=True)  # a transformers-written file
    save_hf(first, tmp_path / "b")
    second = load_hf(tmp_path / "b", dtype=torch.float32)
    assert second.config == first.config and first.config.family == "deepseek_v32"
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(".indexer.weights_proj." in k for k in a)


def test_config_errors_name_the_field():
    hf, cfg = hf_v32()
    adapter = DeepSeekV32Adapter()
    good = cfg.to_dict()
    with pytest.raises(ConfigError, match="q_lora_rank"):
        adapter.config_from_hf({**good, "q_lora_rank": None})
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        adapter.config_from_hf({**good, "mlp_layer_types": ["sparse", "dense", "sparse"]})
    missing = {k: v for k, v in good.items() if k != "index_topk"}
    with pytest.raises(ConfigError, match="index_topk"):
        adapter.config_from_hf(missing)
    with pytest.raises(ConfigError, match="indexer.topk"):
        adapter.config_from_hf({**good, "index_topk": 0})
    ls_cfg = adapter.config_from_hf(good)
    import dataclasses
    no_indexer = dataclasses.replace(ls_cfg, attention=dataclasses.replace(ls_cfg.attention, indexer=None))
    with pytest.raises(ConfigError, match="model.attention.indexer"):
        adapter.config_to_hf(no_indexer)


def test_mtp_block_indexer_round_trips_in_deepseek_layout():
    """An MTP depth's block has its own indexer: written as ``model.layers.{n_layers}.self_attn.indexer.*``
    (DeepSeek's checkpoint layout) and read back bitwise."""
    from lockstep.models.registry import model_config

    cfg = model_config("deepseek_v32", "debug")
    assert cfg.n_mtp == 1
    model = build_model(cfg, seed=3)
    adapter = DeepSeekV32Adapter()
    state = model.state_dict()
    hf_state = adapter.state_to_hf(state, cfg)
    assert "model.layers.3.self_attn.indexer.weights_proj.weight" in hf_state
    back = adapter.state_from_hf(hf_state, cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
