"""GPT-OSS against transformers' GptOssForCausalLM (tiny random configs, no downloads): logits and
gradients in fp32 over unusual shapes (head counts, GQA ratios, windows that divide neither the
sequence nor a cache block, layer schedules, no attention bias, tied head, plain RoPE), the export
path (save_hf -> from_pretrained), load -> save -> load bitwise, and MXFP4 checkpoints."""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

from lockstep.config.base import ConfigError  # noqa: E402
from lockstep.models.common.transformer import build_model  # noqa: E402
from lockstep.models.gpt_oss.mxfp4 import dequantize_mxfp4  # noqa: E402
from lockstep.models.hf import load_hf, save_hf  # noqa: E402
from lockstep.models.hf.parity import family_parity  # noqa: E402
from lockstep.models.registry import model_config  # noqa: E402

# fp32 on both sides, as the other families' parity tests: the models differ only in summation
# order (~1e-6 on these logits); routing is discrete, so router weights are scaled up
# (initializer_range 0.1) to keep top-k margins far above that noise.
LOGITS_ATOL = 1e-4
SEQ = 24

CASES = {
    # 3 layers sliding/full/sliding, GQA 2, window 5 (divides neither 24 nor a 16-slot cache block)
    "base": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5),
    # odd head count, MHA, head_dim 8, window 3, a schedule HF would not default to
    "mha3-window3-schedule": dict(num_attention_heads=3, num_key_value_heads=3, head_dim=8, sliding_window=3,
                                  layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    # GQA 6 (one kv head), window 7, no attention biases, tied head, plain RoPE, 3 experts top-3
    "gqa6-nobias-tied-plainrope": dict(num_attention_heads=6, num_key_value_heads=1, head_dim=12, sliding_window=7,
                                       attention_bias=False, tie_word_embeddings=True, num_local_experts=3,
                                       num_experts_per_tok=3,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # window longer than the sequence: sliding layers are full attention here
    "window-past-seq": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=40),
}


def hf_model(seed: int = 0, **extra) -> GptOssForCausalLM:
    fields = dict(vocab_size=256, hidden_size=48, intermediate_size=40, num_hidden_layers=3,
                  num_local_experts=5, num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.1,
                  rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0})
    cfg = GptOssConfig(**{**fields, **extra}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # HF starts biases at 0 and norms at 1: perturb so a swapped one would show
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks", "norm.weight")):
                p.add_(0.5 * torch.randn_like(p))
    return model


def load(path, **kw):
    """load_hf of a file transformers wrote (no lockstep checksums: allowed where load_hf checks them)."""
    if "allow_unverified" in inspect.signature(load_hf).parameters:
        kw["allow_unverified"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "loaded unverified" warning is expected here
        return load_hf(path, **kw)


TOKENS = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    hf = hf_model(**CASES[case])
    hf.save_pretrained(tmp_path)
    model = load(tmp_path, dtype=torch.float32).eval()
    assert model.config.family == "gpt_oss"
    windows = [layer.attention.window for layer in model.layers.values()]
    assert windows == [hf.config.sliding_window if t == "sliding_attention" else 0 for t in hf.config.layer_types]
    with torch.no_grad():
        ref = hf(TOKENS).logits
        diffs = {}
        for backend in ("sdpa", "reference"):
            for layer in model.layers.values():
                layer.attention.backend_name = backend
            diffs[backend] = (model(TOKENS) - ref).abs().max().item()
    print(f"gpt_oss {case}: max |logits diff| {diffs} (|logits| max {ref.abs().max().item():.3g})")
    assert max(diffs.values()) <= LOGITS_ATOL


def test_sinks_and_windows_change_the_function(tmp_path):
    """The parity above could not pass by accident: zeroed sinks or a dropped window move the logits."""
    hf = hf_model(**CASES["base"])
    hf.save_pretrained(tmp_path)
    model = load(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        base = model(TOKENS)
        model.layers["0"].attention.window = 0
        assert (model(TOKENS) - base).abs().max() > 1e-3
        model.layers["0"].attention.window = 5
        model.layers["1"].attention.sinks.zero_()
        assert (model(TOKENS) - base).abs().max() > 1e-3


def test_gradients_match_transformers(tmp_path):
    hf = hf_model(**CASES["base"]).train()
    hf.save_pretrained(tmp_path)
    model = load(tmp_path, dtype=torch.float32).train()

    def loss_of(logits):
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), TOKENS[:, 1:].reshape(-1))

    loss_of(hf(TOKENS).logits).backward()
    loss_of(model(TOKENS)).backward()
    # the HF gradients in lockstep's names and layouts, through the adapter's own conversion
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    converted = model_adapter().state_from_hf(hf_grads, model.config)
    ours = {n: p.grad for n, p in model.named_parameters()}
    assert set(ours) <= set(converted) and len(ours) > 20
    worst = 0.0
    for name, grad in ours.items():
        torch.testing.assert_close(grad, converted[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        worst = max(worst, (grad - converted[name]).abs().max().item())
    assert ours["layers.0.attention.sinks"].abs().max() > 0  # the sinks do learn
    print(f"gpt_oss gradient parity: max |grad diff| = {worst:.3g} over {len(ours)} tensors")


def model_adapter():
    from lockstep.models.registry import get_model_spec

    return get_model_spec("gpt_oss").hf_adapter


def test_load_save_load_is_bitwise_and_transformers_reads_the_export(tmp_path):
    hf = hf_model(**CASES["mha3-window3-schedule"])
    hf.save_pretrained(tmp_path / "hf")
    first = load(tmp_path / "hf")
    save_hf(first, tmp_path / "ours")
    second = load_hf(tmp_path / "ours")
    assert second.config == first.config
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["layer_types"] == hf.config.layer_types and written["sliding_window"] == 3
    back = GptOssForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    hf_state = hf.state_dict()
    assert all(torch.equal(t, hf_state[n]) for n, t in back.state_dict().items())


def test_family_parity_check_of_the_debug_flavor():
    record = family_parity("gpt_oss")
    assert record["ran"] and record["passed"], record


def test_real_shapes_parameter_counts():
    """openai/gpt-oss-20b / -120b: 20.9B and 116.8B parameters (the model cards' counts)."""
    counts = {}
    for flavor in ("20B", "120B"):
        with torch.device("meta"):
            counts[flavor] = model_config("gpt_oss", flavor).build().num_params()
    assert round(counts["20B"] / 1e9, 1) == 20.9
    assert round(counts["120B"] / 1e9, 1) == 116.8


def test_mxfp4_dequantisation_is_transformers_bitwise():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 10, 2), generator=g, dtype=torch.uint8)
    expected = convert_moe_packed_tensors(blocks, scales)
    for dtype in (torch.bfloat16, torch.float32):
        got = dequantize_mxfp4(blocks, scales, dtype)
        assert got.dtype == dtype and torch.equal(got.float(), expected.float())


def test_mxfp4_checkpoint_loads_dequantised(tmp_path):
    """A checkpoint in the hub's format (experts as blocks + scales, quantization_config mxfp4)."""
    hf = hf_model(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  sliding_window=5)
    g = torch.Generator().manual_seed(3)
    state = {n: t.contiguous() for n, t in hf.state_dict().items()}
    quantised = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, inputs, outputs = state.pop(name).shape
        quantised[name] = (torch.randint(0, 256, (e, outputs, inputs // 32, 16), generator=g, dtype=torch.uint8),
                           torch.randint(120, 128, (e, outputs, inputs // 32), generator=g, dtype=torch.uint8))
        state[name + "_blocks"], state[name + "_scales"] = quantised[name]
    save_file(state, str(tmp_path / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():  # the reference: transformers' own dequantisation put into the HF model
        for name, (blocks, scales) in quantised.items():
            hf.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales).float())
        diff = (model(TOKENS) - hf(TOKENS).logits).abs().max().item()
    assert diff <= LOGITS_ATOL, diff
    assert model.layers["0"].feed_forward.experts.w1.dtype == torch.float32
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quant_method='bitsandbytes' is not supported for gpt_oss"):
        load(tmp_path)


def test_unrepresentable_configs_are_refused_naming_the_field(tmp_path):
    model = build_model(model_config("gpt_oss", "debug"))
    cfg = model.config
    no_sinks = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, sinks=False))
    with pytest.raises(ConfigError, match=r"layers\.0\.attention: HF gpt_oss needs sinks"):
        model_adapter().config_to_hf(no_sinks)
    plain = dataclasses.replace(cfg, feed_forward=dataclasses.replace(cfg.feed_forward, activation="silu"))
    with pytest.raises(ConfigError, match=r"model\.feed_forward\.activation"):
        model_adapter().config_to_hf(plain)
    with pytest.raises(ConfigError, match=r"model\.layer_types"):
        dataclasses.replace(cfg, layer_types=["sliding_attention"]).validate()
    with torch.no_grad():
        model.layers["1"].feed_forward.e_score_correction_bias.fill_(0.5)
    with pytest.raises(ConfigError, match="e_score_correction_bias is non-zero"):
        save_hf(model, tmp_path)
