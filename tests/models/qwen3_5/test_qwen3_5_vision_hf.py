"""Qwen3.5 image-text (dense and MoE) against transformers' Qwen3_5[Moe]ForConditionalGeneration at tiny random
shapes: text-only logits, logits with images (odd grids, two frames, two images in a row), gradients, mRoPE
positions, the vision tower's features, load -> save -> load bitwise, save_hf -> from_pretrained, greedy
generation (reference loop and engine). No downloads."""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from image_text_helpers import (assert_first_row_batch_invariant, assert_grads_close, load_pair,  # noqa: E402
                                mrope_hf_logits)
from qwen3_5_reference import END, IMAGE, MERGE, hf_qwen3_5, image_inputs  # noqa: E402

from lockstep.config.base import ConfigError  # noqa: E402
from lockstep.models.common.gated_deltanet import GatedDeltaNet  # noqa: E402
from lockstep.models.common.moe import MoE  # noqa: E402
from lockstep.models.common.mrope import PartialMRopeConfig, mrope_positions  # noqa: E402
from lockstep.models.hf import load_hf, save_hf  # noqa: E402
from lockstep.models.qwen3_5.config import Qwen3_5VLConfig  # noqa: E402
from lockstep.models.registry import get_model_spec  # noqa: E402

# fp32 on both sides; the models differ in summation order only (attention kernel, patch embedding as a
# matmul instead of a Conv3d, chunked delta rule, expert accumulation): ~1e-5 on these logits (the
# repository-wide HF tolerance, models/hf/parity.py). initializer_range 0.1 keeps top-k margins far above it.
LOGITS_ATOL = 1e-4
# Gradients: the same sums accumulated through backward; relative to each tensor's largest entry.
GRAD_RTOL = 1e-4

# (grids, images per row). Odd merged grids (1x5, 3x1: far from the 5x5 position table's square), an image
# of two frames (t=2: two attention blocks in the tower, two mRoPE time steps), two images in one row.
LAYOUTS = {
    "one_per_row": ([(1, 2, 10), (1, 6, 2)], [[0], [1]]),
    "two_in_a_row": ([(1, 4, 4), (2, 4, 6)], [[0, 1], []]),
}


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def pair(request, tmp_path_factory):
    """(transformers model, lockstep model loaded from its save_pretrained directory, that directory)."""
    return load_pair(hf_qwen3_5(moe=request.param), tmp_path_factory.mktemp("hf"))


def hf_logits(hf, tokens, pixels=None, grid=None):
    return mrope_hf_logits(hf, tokens, IMAGE, pixels, grid)


def test_config_and_layers(pair):
    hf, model, _ = pair
    moe = "Moe" in type(hf).__name__
    assert isinstance(model.config, Qwen3_5VLConfig) and model.config.family == "qwen3_5"
    assert all(isinstance(layer.feed_forward, MoE) == moe for layer in model.layers.values())
    assert [isinstance(layer.attention, GatedDeltaNet) for layer in model.layers.values()] == [False, True, False]
    assert model.config.vision.deepstack_layers == [] and len(model.visual.deepstack_merger_list) == 0
    assert isinstance(model.config.rope, PartialMRopeConfig) and model.config.rope.mrope_section == [2, 1, 1]
    assert model.rope.head_dim == 8  # half of each 16-wide head rotated


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
    tokens, pixels, grid = image_inputs(*LAYOUTS[layout], seed=5)
    with torch.no_grad():
        ref = hf_logits(hf, tokens, pixels, grid)
        out = model(tokens, pixel_values=pixels, grid_thw=grid)
        text_only = model(tokens)
        flat = torch.arange(tokens.shape[1]).expand(3, *tokens.shape)  # images, but text positions
        no_mrope = model(tokens, positions=flat, pixel_values=pixels, grid_thw=grid)
    diff = (out - ref).abs().max().item()
    print(f"{layout}: max |logits diff| = {diff:.3g}")
    assert diff <= LOGITS_ATOL
    # the images and their mRoPE positions both matter (the test could fail)
    assert (text_only - ref).abs().max().item() > 100 * LOGITS_ATOL
    assert (no_mrope - ref).abs().max().item() > 100 * LOGITS_ATOL


def test_vision_features_match(pair):
    hf, model, _ = pair
    _, pixels, grid = image_inputs(*LAYOUTS["two_in_a_row"], seed=6)
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=grid, return_dict=True).pooler_output
        out = model.visual(pixels, grid)
    assert out.deepstack == []
    assert (out.embeds - ref).abs().max().item() <= LOGITS_ATOL


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
    tokens, pixels, grid = image_inputs(*LAYOUTS["two_in_a_row"], seed=8)
    targets = torch.roll(tokens, -1, dims=1)
    hf.train(), model.train()
    try:
        hf.zero_grad(), model.zero_grad()
        ref = F.cross_entropy(hf_logits(hf, tokens, pixels, grid).flatten(0, 1), targets.flatten())
        out = F.cross_entropy(model(tokens, pixel_values=pixels, grid_thw=grid).flatten(0, 1), targets.flatten())
        ref.backward(), out.backward()
    finally:
        hf.eval(), model.eval()
    assert abs(ref.item() - out.item()) <= LOGITS_ATOL
    grads = {n: p.grad for n, p in model.named_parameters()}
    for moe_buffer in [n for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")]:
        grads[moe_buffer] = torch.zeros(1)  # not trained; state_to_hf checks it is zero
    grads = get_model_spec("qwen3_5").hf_adapter.state_to_hf(grads, model.config, fused_experts=True)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == set(hf_grads)
    worst = assert_grads_close(grads, hf_grads, GRAD_RTOL)
    assert grads["model.visual.pos_embed.weight"].abs().max() > 0  # the tower is trained too
    print(f"gradients: worst relative diff {worst:.3g} over {len(hf_grads)} tensors")


def test_load_save_load_bitwise(pair, tmp_path):
    _, model, source = pair
    save_hf(model, tmp_path)
    again = load_hf(tmp_path, dtype=torch.float32)
    assert again.config.slots() == model.config.slots() and again.config.vision == model.config.vision
    first, second = model.state_dict(), again.state_dict()
    assert set(first) == set(second) and any(k.startswith("visual.") for k in first)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    written = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    assert written["model_type"] == original["model_type"]
    assert "deepstack_visual_indexes" not in written["vision_config"]
    assert written["text_config"]["rope_parameters"]["mrope_section"] == [2, 1, 1]


def test_save_hf_loads_in_transformers(pair, tmp_path):
    hf, model, _ = pair
    save_hf(model, tmp_path)
    back = type(hf).from_pretrained(tmp_path, attn_implementation="eager").eval()
    theirs = back.state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(theirs[name], tensor), name
    tokens, pixels, grid = image_inputs(*LAYOUTS["two_in_a_row"], seed=9)
    with torch.no_grad():
        diff = (hf_logits(back, tokens, pixels, grid) - model(tokens, pixel_values=pixels, grid_thw=grid)).abs().max()
    assert diff.item() <= LOGITS_ATOL


def test_config_errors_name_the_field():
    adapter = get_model_spec("qwen3_5").hf_adapter
    good = hf_qwen3_5(moe=False).config.to_dict()
    for section, field, value, match in [
        ("vision_config", "hidden_act", "relu", "vision_config.hidden_act"),
        ("vision_config", "out_hidden_size", 32, "out_hidden_size"),
    ]:
        bad = json.loads(json.dumps(good))
        bad[section][field] = value
        with pytest.raises(ConfigError, match=match):
            adapter.config_from_hf(bad)
    bad = json.loads(json.dumps(good))
    bad["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]  # 6 frequencies for 4
    with pytest.raises(ConfigError, match="mrope_section"):
        adapter.config_from_hf(bad).build()


def test_placeholder_mismatch_is_a_clear_error(pair):
    _, model, _ = pair
    tokens, pixels, grid = image_inputs(*LAYOUTS["one_per_row"], seed=10)
    tokens[0, tokens[0].tolist().index(END) - 1] = 7  # one placeholder short
    with pytest.raises(ValueError, match="placeholder"):
        model(tokens, pixel_values=pixels, grid_thw=grid)


@pytest.mark.parametrize("pair", [False], ids=["dense"], indirect=True)  # the decode loop is the same for MoE
def test_greedy_generation_equals_transformers_generate(pair):
    """Two images in one prompt: transformers' generate, the full-recompute reference and the engine (paged KV
    cache + Gated DeltaNet state, prefill in 8-token chunks so that the images straddle chunks) agree."""
    from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
    from lockstep.generate.vision import PixelImage
    from lockstep.models.qwen3_vl.model import greedy_generate

    hf, model, _ = pair
    tokens, pixels, grid = image_inputs(*LAYOUTS["two_in_a_row"], seed=11)
    tokens = tokens[:1]  # one row: both images; no padding on either side
    hf.model.rope_deltas = None
    ref = hf.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=5, do_sample=False,
                      pad_token_id=0, pixel_values=pixels, image_grid_thw=grid,
                      mm_token_type_ids=(tokens == IMAGE).int())
    out = greedy_generate(model, tokens, pixels, grid, max_new_tokens=5)
    assert torch.equal(out, ref), (out[0, -5:].tolist(), ref[0, -5:].tolist())
    first = int(grid[0].prod())
    images = [PixelImage(pixels[:first], tuple(grid[0].tolist())), PixelImage(pixels[first:], tuple(grid[1].tolist()))]
    engine = Engine(model, None, EngineConfig(cache_memory_mb=4, block_size=4, max_batch_size=2, prefill_chunk=8))
    result = engine.generate([Request(prompt_ids=tokens[0].tolist(), images=images,
                                      sampling=SamplingParams(temperature=0, max_new_tokens=5))])[0]
    assert result.token_ids == ref[0, tokens.shape[1]:].tolist()


def test_multimodal_processor_is_qwen3_vl_s():
    """Qwen3.5 uses Qwen3-VL's processor classes (lockstep.data.images matches them: tests/models/qwen3_vl)."""
    from transformers.models.auto import image_processing_auto, processing_auto

    assert processing_auto.PROCESSOR_MAPPING_NAMES["qwen3_5"] == processing_auto.PROCESSOR_MAPPING_NAMES["qwen3_vl"]
    images = image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES
    assert images["qwen3_5"] == images["qwen3_5_moe"] == images["qwen3_vl"]


def test_batch_invariant_mode_with_images(pair):
    tokens, pixels, grid = image_inputs(*LAYOUTS["one_per_row"], seed=12)
    assert_first_row_batch_invariant(pair[2], tokens, pixels, grid)
