"""Qwen3-VL (dense and MoE) against transformers' Qwen3VL[Moe]ForConditionalGeneration at tiny random shapes:
text-only logits, logits with images of different sizes (one and two per row), gradients, mRoPE positions,
the vision tower's features, and load -> save -> load bitwise. No downloads."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from image_text_helpers import (assert_first_row_batch_invariant, assert_grads_close, load_pair,  # noqa: E402
                                mrope_hf_logits)
from qwen3_vl_reference import END, IMAGE, MERGE, hf_qwen3_vl, image_inputs  # noqa: E402

from lockstep.config.base import ConfigError  # noqa: E402
from lockstep.models.common.mrope import mrope_positions  # noqa: E402
from lockstep.models.common.moe import MoE  # noqa: E402
from lockstep.models.hf import load_hf, save_hf  # noqa: E402
from lockstep.models.registry import get_model_spec  # noqa: E402

# fp32 on both sides; the models differ in summation order only (attention kernel, patch embedding as a
# matmul instead of a Conv3d, expert accumulation): ~1e-6 on these logits. Routing is discrete, so
# initializer_range is 0.1 to keep top-k margins far above that.
LOGITS_ATOL = 1e-4
# Gradients: the same sums, accumulated through backward; relative to each tensor's largest entry.
GRAD_RTOL = 1e-4

# (grids, images per row): two images of different sizes, one per row; then both in one row
LAYOUTS = {
    "one_per_row": ([(1, 4, 6), (1, 6, 4)], [[0], [1]]),
    "two_in_a_row": ([(1, 4, 4), (1, 2, 8)], [[0, 1], []]),
}


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def pair(request, tmp_path_factory):
    """(transformers model, lockstep model loaded from its save_pretrained directory, that directory)."""
    return load_pair(hf_qwen3_vl(moe=request.param), tmp_path_factory.mktemp("hf"))


def hf_logits(hf, tokens, pixels=None, grid=None):
    return mrope_hf_logits(hf, tokens, IMAGE, pixels, grid)


def test_config_and_layers(pair):
    hf, model, _ = pair
    moe = "Moe" in type(hf).__name__
    assert model.config.family == "qwen3_vl"
    assert all(isinstance(layer.feed_forward, MoE) == moe for layer in model.layers.values())
    assert model.config.vision.deepstack_layers == [0, 2]
    assert model.config.rope.mrope_section == [2, 3, 3]


def test_text_only_logits(pair):
    hf, model, _ = pair
    tokens = torch.randint(0, 240, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (model(tokens) - hf_logits(hf, tokens)).abs().max().item()
    print(f"text-only max |logits diff| = {diff:.3g}")
    assert diff <= LOGITS_ATOL


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_image_logits(pair, layout):
    hf, model, _ = pair
    grids, rows = LAYOUTS[layout]
    tokens, pixels, grid = image_inputs(grids, rows, seed=5)
    with torch.no_grad():
        ref = hf_logits(hf, tokens, pixels, grid)
        out = model(tokens, pixel_values=pixels, grid_thw=grid)
        text_only = model(tokens)
    diff = (out - ref).abs().max().item()
    print(f"{layout}: max |logits diff| = {diff:.3g}")
    assert diff <= LOGITS_ATOL
    # the images matter: without them the logits are far off (the test could fail)
    assert (text_only - ref).abs().max().item() > 100 * LOGITS_ATOL


def test_vision_features_match(pair):
    hf, model, _ = pair
    tokens, pixels, grid = image_inputs(*LAYOUTS["one_per_row"], seed=6)
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=grid, return_dict=True)
        out = model.visual(pixels, grid)
    assert (out.embeds - ref.pooler_output).abs().max().item() <= LOGITS_ATOL
    assert len(out.deepstack) == len(ref.deepstack_features) == 2
    for mine, theirs in zip(out.deepstack, ref.deepstack_features):
        assert (mine - theirs).abs().max().item() <= LOGITS_ATOL


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mrope_positions_equal_get_rope_index(pair, layout):
    hf, _, _ = pair
    tokens, _, grid = image_inputs(*LAYOUTS[layout], seed=7)
    ref, ref_deltas = hf.model.get_rope_index(tokens, (tokens == IMAGE).int(), image_grid_thw=grid)
    positions, deltas = mrope_positions(tokens, grid, IMAGE, MERGE)
    assert torch.equal(positions, ref)
    assert torch.equal(deltas, ref_deltas.view(-1))


def test_gradients_match(pair):
    hf, model, _ = pair
    tokens, pixels, grid = image_inputs(*LAYOUTS["one_per_row"], seed=8)
    targets = torch.roll(tokens, -1, dims=1)
    hf.train(), model.train()
    try:
        hf.zero_grad(), model.zero_grad()
        ref = torch.nn.functional.cross_entropy(hf_logits(hf, tokens, pixels, grid).flatten(0, 1), targets.flatten())
        out = torch.nn.functional.cross_entropy(model(tokens, pixel_values=pixels, grid_thw=grid).flatten(0, 1),
                                                targets.flatten())
        ref.backward(), out.backward()
    finally:
        hf.eval(), model.eval()
    assert abs(ref.item() - out.item()) <= LOGITS_ATOL
    adapter = get_model_spec("qwen3_vl").hf_adapter
    grads = adapter.state_to_hf({n: p.grad for n, p in model.named_parameters()}, model.config)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == set(hf_grads)
    worst = assert_grads_close(grads, hf_grads, GRAD_RTOL)
    print(f"gradients: worst relative diff {worst:.3g} over {len(hf_grads)} tensors")


def test_load_save_load_bitwise(pair, tmp_path):
    _, model, source = pair
    save_hf(model, tmp_path)
    again = load_hf(tmp_path, dtype=torch.float32)
    first, second = model.state_dict(), again.state_dict()
    assert set(first) == set(second)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    # and the saved file holds transformers' names and shapes exactly
    written = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    assert written["model_type"] == original["model_type"]
    assert written["vision_config"]["deepstack_visual_indexes"] == [0, 2]


def test_save_hf_loads_in_transformers(pair, tmp_path):
    hf, model, _ = pair
    save_hf(model, tmp_path)
    cls = type(hf)
    back = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    tokens, pixels, grid = image_inputs(*LAYOUTS["two_in_a_row"], seed=9)
    with torch.no_grad():
        diff = (hf_logits(back, tokens, pixels, grid) - model(tokens, pixel_values=pixels, grid_thw=grid)).abs().max()
    assert diff.item() <= LOGITS_ATOL


def test_hub_layout_experts_and_errors():
    hf = hf_qwen3_vl(moe=True)
    adapter = get_model_spec("qwen3_vl").hf_adapter
    cfg = adapter.config_from_hf(hf.config.to_dict())
    state = dict(hf.state_dict())
    # the released checkpoints store experts transposed ([E, D, 2F] and [E, F, D])
    hub = {k: (v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v) for k, v in state.items()}
    a, b = adapter.state_from_hf(state, cfg), adapter.state_from_hf(hub, cfg)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    bad = hf.config.to_dict()
    bad["vision_config"]["hidden_act"] = "relu"
    with pytest.raises(ConfigError, match="vision_config.hidden_act"):
        adapter.config_from_hf(bad)
    bad = hf.config.to_dict()
    bad["vision_config"]["out_hidden_size"] = 32
    with pytest.raises(ConfigError, match="out_hidden_size"):
        adapter.config_from_hf(bad)


def test_placeholder_mismatch_is_a_clear_error(pair):
    _, model, _ = pair
    tokens, pixels, grid = image_inputs(*LAYOUTS["one_per_row"], seed=10)
    tokens[0, tokens[0].tolist().index(END) - 1] = 7  # one placeholder short
    with pytest.raises(ValueError, match="placeholder"):
        model(tokens, pixel_values=pixels, grid_thw=grid)


@pytest.mark.parametrize("layout", ["two_in_a_row", "text_only"])
def test_greedy_generation_equals_transformers_generate(pair, layout):
    from lockstep.models.qwen3_vl.model import greedy_generate

    hf, model, _ = pair
    if layout == "text_only":
        tokens = torch.randint(0, 240, (1, 12), generator=torch.Generator().manual_seed(11))
        pixels = grid = None
        kwargs = {}
    else:
        tokens, pixels, grid = image_inputs(*LAYOUTS[layout], seed=11)
        tokens = tokens[:1]  # one row: both images; no padding on either side
        kwargs = dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(tokens == IMAGE).int())
    hf.model.rope_deltas = None
    # an explicit all-ones mask: else generate takes the token equal to pad_token_id for padding
    ref = hf.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=8, do_sample=False,
                      pad_token_id=0, **kwargs)
    out = greedy_generate(model, tokens, pixels, grid, max_new_tokens=8)
    assert torch.equal(out, ref), (out[0, -8:].tolist(), ref[0, -8:].tolist())


@pytest.mark.parametrize("flavor", ["debug", "debug-moe"])
def test_family_parity_check_runs_for_qwen3_vl(flavor):
    from lockstep.models.hf.parity import TOLERANCE, family_parity

    result = family_parity("qwen3_vl", flavor)  # the trainer's start-up check (output.parity_check)
    assert result["ran"] and result["passed"] and result["max_abs_diff"] <= TOLERANCE


@pytest.mark.parametrize("flavor", ["2B", "8B", "30B-A3B"])
def test_real_shape_flavors_match_transformers_parameter_counts(flavor):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from lockstep.models.common.transformer import build_meta_model
    from lockstep.models.registry import model_config

    cfg = model_config("qwen3_vl", flavor)
    hf_dict = get_model_spec("qwen3_vl").hf_adapter.config_to_hf(cfg)
    hf_cfg = AutoConfig.for_model(**hf_dict)
    with torch.device("meta"):
        hf = AutoModelForImageTextToText.from_config(hf_cfg)
        ours = build_meta_model(cfg)
    hf_count = sum(p.numel() for p in hf.parameters())  # a tied head is one parameter on both sides
    assert ours.num_params() == hf_count, (ours.num_params(), hf_count)
    print(f"{flavor}: {hf_count / 1e9:.2f}B parameters")


def test_batch_invariant_mode_with_images(pair):
    tokens, pixels, grid = image_inputs(*LAYOUTS["one_per_row"], seed=12)
    assert_first_row_batch_invariant(pair[2], tokens, pixels, grid)
