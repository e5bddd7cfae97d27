"""``lockstep train`` with images: the ``debug-qwen3-vl`` recipe (a shape image + caption and a Shakespeare
window in every row, lockstep.data.image_mix) trains through the trainer's step seam and its loss falls;
the loader's rows, rank slices and resume; the layouts and models image batches refuse."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.data.image_mix import ImageMixConfig, ImageMixLoader, caption_samples, processor_for, vision_tokens
from lockstep.data.image_samples import IGNORE
from lockstep.recipes.registry import get_recipe
from lockstep.recipes.vision import shakespeare_vl_model
from tests.image_text_helpers import train_vision_recipe


class _WordTokenizer:
    """A stand-in tokenizer (ids 1..): the loader tests need no corpus."""

    vocab_size, eos_id = 100, 1

    def encode(self, text: str) -> list[int]:
        return [2 + sum(map(ord, w)) % 90 for w in text.split()]


def _loader(rank=0, world_size=1, n=8, seq_len=40, batch_size=2, seed=3):
    model = shakespeare_vl_model()
    ids = vision_tokens(model, _WordTokenizer.vocab_size)
    samples = caption_samples(n, _WordTokenizer(), marker=ids.marker, size=64, seed=0)
    text = torch.arange(10, 90).repeat(4)
    return ImageMixLoader(samples, text, ids, processor_for(model), seq_len=seq_len, batch_size=batch_size,
                          seed=seed, rank=rank, world_size=world_size), ids


def test_rows_mix_image_and_text_with_equal_scored_tokens():
    loader, ids = _loader()
    batch = next(loader)
    assert batch.tokens.shape == (2, 40) and batch.grid_thw.tolist() == [[1, 8, 8]] * 2
    assert ((batch.tokens == ids.image_token_id).sum(dim=1) == 16).all()  # one 64x64 image (8x8 patches) a row
    assert batch.tokens[0, 0] == ids.vision_start_token_id and batch.tokens[1, 0] != ids.vision_start_token_id
    scored = (batch.targets != IGNORE).sum(dim=1)
    assert scored.tolist() == [40 - 1 - 16] * 2  # every row: all but the last position and the 16 placeholders
    assert (batch.tokens != 0).all()  # rows are filled to seq_len by the text window: no padding


def test_ranks_split_the_global_batch_and_resume():
    whole, _ = _loader(batch_size=4)
    parts = [_loader(rank=r, world_size=2)[0] for r in range(2)]
    want = next(whole)
    got = [next(p) for p in parts]
    assert torch.equal(torch.cat([g.tokens for g in got]), want.tokens)
    assert torch.equal(torch.cat([g.pixel_values for g in got]), want.pixel_values)
    first, _ = _loader()
    [next(first) for _ in range(5)]  # into the second epoch (4 batches of 2 from 8 samples)
    state = first.state_dict()
    after = next(first)
    again, _ = _loader()
    again.load_state_dict(state)
    assert torch.equal(next(again).tokens, after.tokens)


def test_image_batches_refuse_other_layouts_and_text_models():
    cfg = get_recipe("debug-qwen3-vl").config()
    cfg.validate()
    for field in ("cp", "pp"):
        bad = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **{field: 2}))
        with pytest.raises(ConfigError, match=rf"^parallel\.{field}: image\+text batches .* got {field}=2: "):
            bad.validate()
    dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=2)).validate()  # parallel/visual.py
    graph = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, mode="graph"))
    with pytest.raises(ConfigError, match=r"^training\.mode: image\+text batches"):
        graph.validate()
    from lockstep.models.registry import model_config

    text_model = dataclasses.replace(cfg, model=model_config("qwen3", "debug"))
    with pytest.raises(ConfigError, match=r"^data\.images\.source: image samples need a vision-language model"):
        text_model.validate()
    clash = dataclasses.replace(cfg, model=model_config("qwen3_vl", "debug"))  # image ids inside the 4096 BPE ids
    with pytest.raises(ConfigError, match=r"^data\.images\.source: the tokenizer's ids \[0, 4096\) overlap"):
        clash.validate()
    with pytest.raises(ConfigError, match=r"^data\.images\.source: image samples need a vision-language model"):
        vision_tokens(model_config("llama3", "debug"), 4096)
    with pytest.raises(ConfigError, match=r"^data\.images\.source: the tokenizer's ids \[0, 4096\) overlap"):
        vision_tokens(model_config("qwen3_vl", "debug"), 4096)
    with pytest.raises(ConfigError, match=r"^data\.images\.source: must be one of"):
        ImageMixConfig(source="photos").validate()


def test_debug_qwen3_vl_recipe_trains(tmp_path):
    cfg, batch, result, unmoved = train_vision_recipe("debug-qwen3-vl", tmp_path / "run")
    assert batch.grid_thw.shape[0] == cfg.training.batch_size  # an image in every row
    # measured 8.31 -> 7.48 in 8 steps; a step that saw no image or no gradient would not move the tower
    assert result.losses[-1] < result.losses[0] - 0.4
    assert not unmoved
