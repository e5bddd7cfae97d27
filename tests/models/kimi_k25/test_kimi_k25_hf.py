"""Kimi K2.5 against transformers' Kimi_K25ForConditionalGeneration at tiny random shapes: text-only logits,
logits with images of different sizes (one and two per row), MoonViT's features, gradients, load -> save -> load
bitwise, transformers loading what we save, greedy generation with images. No downloads."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from image_text_helpers import assert_grads_close, load_pair  # noqa: E402
from kimi_k25_reference import END, hf_kimi_k25, image_inputs  # noqa: E402

from lockstep.config.base import ConfigError  # noqa: E402
from lockstep.models.hf import load_hf, save_hf  # noqa: E402
from lockstep.models.registry import get_model_spec  # noqa: E402

# fp32 on both sides; the models differ in summation order only (attention kernel, patch embedding as a matmul
# instead of a Conv2d, the bicubic taps summed by embedding_bag in another order, expert accumulation): ~1e-6
# on these logits. Weights are drawn with std 0.2 so top-k routing margins stay far above that.
LOGITS_ATOL = 1e-4
# Gradients: the same sums, accumulated through backward; relative to each tensor's largest entry.
GRAD_RTOL = 1e-4

# (grids, images per row): two images of different sizes (smaller and larger than the 5x5 position table,
# one not square), one per row; then both in one row
LAYOUTS = {
    "one_per_row": ([(1, 4, 6), (1, 8, 2)], [[0], [1]]),
    "two_in_a_row": ([(1, 4, 4), (1, 2, 8)], [[0, 1], []]),
}


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def pair(request, tmp_path_factory):
    """(transformers model, lockstep model loaded from its save_pretrained directory, that directory)."""
    return load_pair(hf_kimi_k25(tie=request.param), tmp_path_factory.mktemp("hf"))


def hf_logits(hf, tokens, pixels=None, grid=None):
    kwargs = {} if pixels is None else dict(pixel_values=pixels, image_grid_thw=grid)
    return hf(input_ids=tokens, **kwargs).logits


def test_config(pair):
    hf, model, _ = pair
    assert model.config.family == "kimi_k25"
    assert model.config.vision.pos_emb_side == 5 and model.config.vision.depth == 3
    assert model.config.tie_embeddings == hf.config.tie_word_embeddings


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
    diff = (out - ref).abs().max().item()
    print(f"{layout}: max |logits diff| = {diff:.3g}")
    assert diff <= LOGITS_ATOL
    # the images matter: without them the logits are far off (the test could fail)
    assert (text_only - ref).abs().max().item() > 100 * LOGITS_ATOL


def test_vision_features_match(pair):
    hf, model, _ = pair
    _, pixels, grid = image_inputs(*LAYOUTS["one_per_row"], seed=6)
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(pixels, grid, return_dict=True).pooler_output)
        out = model.visual(pixels, grid)
    assert out.deepstack == []
    assert (out.embeds - ref).abs().max().item() <= LOGITS_ATOL


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
    # transformers' in-memory gradients, renamed and reshaped into lockstep's layout (the adapter reads both)
    adapter = get_model_spec("kimi_k25").hf_adapter
    hf_grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad) for n, p in hf.named_parameters()}
    hf_grads.update({n: b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")})  # not trained
    hf_grads = adapter.state_from_hf(hf_grads, model.config)
    grads = {n: p.grad for n, p in model.named_parameters()}
    extra = {n for n in set(hf_grads) - set(grads) if not n.endswith("e_score_correction_bias")}
    assert set(grads) <= set(hf_grads) and extra <= {"output.weight"}  # a tied head is the embedding on our side
    hf_grads = {n: hf_grads[n] for n in grads}
    worst = assert_grads_close(grads, hf_grads, GRAD_RTOL)
    assert grads["visual.pos_embed"].abs().max() > 0 and grads["visual.projector.in_proj.weight"].abs().max() > 0
    print(f"gradients: worst relative diff {worst:.3g} over {len(hf_grads)} tensors")


def test_load_save_load_bitwise(pair, tmp_path):
    _, model, source = pair
    save_hf(model, tmp_path)
    again = load_hf(tmp_path, dtype=torch.float32, allow_unverified=True)
    first, second = model.state_dict(), again.state_dict()
    assert set(first) == set(second)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    written = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    assert written["model_type"] == original["model_type"] == "kimi_k25"
    assert written["vision_config"]["pos_emb_height"] == 5
    # the file holds exactly the tensor names and shapes transformers' save_pretrained wrote
    from safetensors import safe_open

    def shapes(directory):
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes(tmp_path) == shapes(source)


@pytest.mark.parametrize("flavor", ["debug", "K2.5"])
def test_flavors_match_transformers_parameter_counts(flavor):
    from transformers import AutoConfig, Kimi_K25ForConditionalGeneration

    from lockstep.models.common.transformer import build_meta_model
    from lockstep.models.registry import model_config

    cfg = model_config("kimi_k25", flavor)
    hf_cfg = AutoConfig.for_model(**get_model_spec("kimi_k25").hf_adapter.config_to_hf(cfg))
    with torch.device("meta"):
        hf = Kimi_K25ForConditionalGeneration(hf_cfg)
        ours = build_meta_model(cfg)
    hf_count = sum(p.numel() for p in hf.parameters())  # a tied head is one parameter on both sides
    assert ours.num_params() == hf_count, (ours.num_params(), hf_count)
    print(f"{flavor}: {hf_count / 1e9:.4f}B parameters")


def test_save_hf_loads_in_transformers(pair, tmp_path):
    hf, model, _ = pair
    save_hf(model, tmp_path)
    back = type(hf).from_pretrained(tmp_path, attn_implementation="eager").eval()
    reference = hf.state_dict()
    assert set(back.state_dict()) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(back.state_dict()[name], tensor), name
    tokens, pixels, grid = image_inputs(*LAYOUTS["two_in_a_row"], seed=9)
    with torch.no_grad():
        diff = (hf_logits(back, tokens, pixels, grid) - model(tokens, pixel_values=pixels, grid_thw=grid)).abs().max()
    assert diff.item() <= LOGITS_ATOL


def test_config_errors_name_the_field():
    hf = hf_kimi_k25()
    adapter = get_model_spec("kimi_k25").hf_adapter
    for field, value, match in (("hidden_act", "relu", "vision_config.hidden_act"),
                                ("pos_emb_width", 7, "vision_config.pos_emb_width")):
        bad = hf.config.to_dict()
        bad["vision_config"][field] = value
        with pytest.raises(ConfigError, match=match):
            adapter.config_from_hf(bad)
    bad = hf.config.to_dict()
    bad["projection_hidden_size"] = 8
    with pytest.raises(ConfigError, match="projection_hidden_size"):
        adapter.config_from_hf(bad)


def test_bad_inputs_are_clear_errors(pair):
    _, model, _ = pair
    tokens, pixels, grid = image_inputs(*LAYOUTS["one_per_row"], seed=10)
    short = tokens.clone()
    short[0, short[0].tolist().index(END) - 1] = 7  # one placeholder short
    with pytest.raises(ValueError, match="placeholder"):
        model(short, pixel_values=pixels, grid_thw=grid)
    with pytest.raises(ValueError, match="videos are not implemented"):
        model(tokens, pixel_values=torch.cat([pixels, pixels]), grid_thw=grid * torch.tensor([2, 1, 1]))


@pytest.mark.parametrize("layout", ["two_in_a_row", "text_only"])
def test_greedy_generation_equals_transformers_generate(pair, layout):
    from lockstep.models.kimi_k25.model import greedy_generate

    hf, model, _ = pair
    if layout == "text_only":
        tokens = torch.randint(0, 240, (1, 12), generator=torch.Generator().manual_seed(11))
        pixels = grid = None
        kwargs = {}
    else:
        tokens, pixels, grid = image_inputs(*LAYOUTS[layout], seed=11)
        tokens = tokens[:1]  # one row: both images; no padding on either side
        kwargs = dict(pixel_values=pixels, image_grid_thw=grid)
    # an explicit all-ones mask: else generate takes the token equal to pad_token_id for padding
    ref = hf.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=8, do_sample=False,
                      pad_token_id=0, **kwargs)
    out = greedy_generate(model, tokens, pixels, grid, max_new_tokens=8)
    assert torch.equal(out, ref), (out[0, -8:].tolist(), ref[0, -8:].tolist())


def test_family_parity_check_runs_for_kimi_k25():
    from lockstep.models.hf.parity import TOLERANCE, family_parity

    result = family_parity("kimi_k25", "debug")  # the trainer's start-up check (output.parity_check)
    assert result["ran"] and result["passed"] and result["max_abs_diff"] <= TOLERANCE
