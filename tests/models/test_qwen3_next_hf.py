"""Qwen3-Next and Qwen3.5 (dense, MoE, multimodal text part) against transformers 5.19's own
models, tiny random configs (no downloads): logits and gradients in fp32, unusual shapes, the
layer schedule, save_hf -> from_pretrained, and load -> save -> load bitwise."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from lockstep.models.common.gated_deltanet import GatedDeltaNet  # noqa: E402
from lockstep.models.common.moe import MoE  # noqa: E402
from lockstep.models.common.transformer import build_model  # noqa: E402
from lockstep.models.hf import load_hf as _load_hf, save_hf  # noqa: E402
from lockstep.models.registry import get_model_spec, model_config  # noqa: E402

# fp32 on both sides, same algorithms (chunked delta rule, 64-token chunks): the models differ only
# in summation order, ~1e-6 on these logits; the repository-wide HF tolerance (models/hf/parity.py).
LOGITS_ATOL = 1e-4


def load_hf(path, **kwargs):
    """load_hf of a transformers-written directory (no lockstep checksums: read unverified where the
    loader verifies checksums)."""
    if "allow_unverified" in inspect.signature(_load_hf).parameters:
        kwargs.setdefault("allow_unverified", True)
    return _load_hf(path, **kwargs)

BASE = dict(vocab_size=256, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_num_key_heads=2, linear_num_value_heads=4)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=28)

CASES = {
    # Qwen3-Next MoE: grouped qkvz/ba projections, 2 value heads per key head, Dk != Dv
    "next-moe": ("qwen3_next", dict(**MOE, intermediate_size=40)),
    # Qwen3-Next with dense layers mixed in (decoder_sparse_step, mlp_only_layers), conv kernel 2
    "next-mixed": ("qwen3_next", dict(**MOE, intermediate_size=40, decoder_sparse_step=2, mlp_only_layers=[3],
                                      linear_conv_kernel_dim=2, norm_topk_prob=False)),
    # Qwen3.5 dense: 6 heads / 3 kv heads, explicit layer_types, one key head per value head, conv 3, tied
    "35-dense": ("qwen3_5_text", dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                      intermediate_size=40, linear_num_key_heads=3, linear_num_value_heads=3,
                                      linear_key_head_dim=12, linear_value_head_dim=8, linear_conv_kernel_dim=3,
                                      num_hidden_layers=3, tie_word_embeddings=True,
                                      layer_types=["linear_attention", "full_attention", "linear_attention"])),
    # Qwen3.5 MoE: one key head for 4 value heads, half the head rotated, mRoPE sections (text positions)
    "35-moe": ("qwen3_5_moe_text", dict(**MOE, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=4,
                                        linear_key_head_dim=16, linear_value_head_dim=4,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.5,
                                                         "mrope_section": [3, 3, 2], "mrope_interleaved": True})),
}
_CLASSES = {"qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
            "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
            "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")}


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough that every part matters (HF's init zeroes norms and makes logits ~0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.2 if p.ndim == 1 else (0.4 if "conv1d" in name else 0.15)
            p.copy_(scale * torch.randn(p.shape, generator=gen))


def hf_model(case: str, seed: int = 0) -> torch.nn.Module:
    model_type, extra = CASES[case]
    cfg_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[model_type])
    fields = {**BASE, **extra}
    fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    cfg = cfg_cls(**fields)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    randomize_(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def tokens(t: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (2, t), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path, dtype=torch.float32).eval()
    cfg = model.config
    assert cfg.family == ("qwen3_next" if case.startswith("next") else "qwen3_5")
    kinds = ["linear_attention" if isinstance(layer.attention, GatedDeltaNet) else "full_attention"
             for layer in model.layers.values()]
    assert kinds == hf.config.layer_types
    moe = [isinstance(layer.feed_forward, MoE) for layer in model.layers.values()]
    assert moe == [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    for t in (24, 70):  # 70 > one 64-token chunk: the carried state across chunks is exercised
        ids = tokens(t)
        with torch.no_grad():
            diff = max_diff(model(ids), hf(ids).logits)
        print(f"{case} T={t}: max |logits diff| = {diff:.3g}")
        assert diff <= LOGITS_ATOL


@pytest.mark.parametrize("case", ["next-moe", "35-dense"])
def test_gradients_match_transformers(case, tmp_path):
    hf = hf_model(case).train()
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path, dtype=torch.float32).train()
    ids = tokens(40)

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    loss_of(hf(ids).logits).backward()
    loss_of(model(ids)).backward()
    adapter = get_model_spec(model.config.family).hf_adapter
    grads = {n: p.grad for n, p in model.named_parameters()}
    if model.config.tie_embeddings:
        grads["output.weight"] = grads["tok_embeddings.weight"]
    for moe_buffer in [n for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")]:
        grads[moe_buffer] = torch.zeros(1)
    ours = adapter.state_to_hf(grads, model.config, fused_experts=True)
    theirs = dict(hf.named_parameters())
    assert set(ours) == set(theirs)
    worst = 0.0
    for name, p in theirs.items():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        worst = max(worst, max_diff(ours[name], p.grad))
    print(f"{case}: max |grad diff| = {worst:.3g} over {len(theirs)} tensors")


def test_multimodal_checkpoint_text_part(tmp_path):
    """A Qwen3.5-MoE image-text checkpoint: text_config + model.language_model.* weights (the vision tower
    loads too: tests/models/qwen3_5 checks it); logits equal the HF model's on text; saving keeps the
    multimodal layout."""
    text = {**BASE, **MOE, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                                "mrope_interleaved": True}}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48,
                  patch_size=4, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
                                        vision_start_token_id=252, vision_end_token_id=253)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    randomize_(hf)
    hf.save_pretrained(tmp_path / "mm")
    assert json.loads((tmp_path / "mm" / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    model = load_hf(tmp_path / "mm", dtype=torch.float32).eval()
    assert model.config.family == "qwen3_5" and model.config.hf_multimodal
    ids = tokens()
    with torch.no_grad():
        diff = max_diff(model(ids), hf(input_ids=ids).logits)
    print(f"qwen3_5_moe multimodal text part: max |logits diff| = {diff:.3g}")
    assert diff <= LOGITS_ATOL
    save_hf(model, tmp_path / "back")
    again = load_hf(tmp_path / "back", dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("case", list(CASES))
def test_load_save_load_is_bitwise(case, tmp_path):
    hf_model(case).save_pretrained(tmp_path / "hf")
    first = load_hf(tmp_path / "hf")
    save_hf(first, tmp_path / "lockstep")
    second = load_hf(tmp_path / "lockstep")
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert second.config.slots() == first.config.slots()


@pytest.mark.parametrize("family,flavor", [("qwen3_next", "debug"), ("qwen3_5", "debug"), ("qwen3_5", "debug-moe")])
def test_save_hf_loads_in_transformers(family, flavor, tmp_path):
    """Our own flavors exported: transformers' from_pretrained computes the same logits."""
    model = build_model(model_config(family, flavor), seed=0).eval()
    randomize_(model, seed=3)  # lockstep's init leaves norms at identity and routing near-uniform
    save_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = max_diff(model(ids), hf(input_ids=ids).logits)
    print(f"{family}/{flavor} save_hf -> transformers: max |logits diff| = {diff:.3g}")
    assert diff <= LOGITS_ATOL


@pytest.mark.parametrize("family,flavor,hf_type", [("qwen3_next", "80B-A3B", "qwen3_next"),
                                                   ("qwen3_5", "35B-A3B", "qwen3_5_moe_text"),
                                                   ("qwen3_5", "9B", "qwen3_5_text")])
def test_real_shapes_match_transformers_parameter_count(family, flavor, hf_type):
    """The real-shape flavors build (on the meta device) the same parameters transformers builds
    from their exported config.json."""
    from lockstep.models.common.transformer import build_meta_model

    cfg = model_config(family, flavor)
    ours = build_meta_model(cfg)
    hf_cfg = get_model_spec(family).hf_adapter.config_to_hf(cfg)
    assert hf_cfg["model_type"] == hf_type
    config_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[hf_type])
    fields = {k: v for k, v in hf_cfg.items() if k not in ("model_type", "architectures")}
    with torch.device("meta"):
        theirs = model_cls(config_cls(**fields))
    n_ours, n_theirs = ours.num_params(), sum(p.numel() for p in theirs.parameters())
    print(f"{family}/{flavor}: {n_ours / 1e9:.2f}B parameters")
    assert n_ours == n_theirs

