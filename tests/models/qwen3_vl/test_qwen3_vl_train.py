"""Image+text samples end to end: the sample format and collation, then a tiny Qwen3-VL (debug flavor) trained on
generated shape images + captions, whose loss falls."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lockstep.data.image_samples import IGNORE, ImageTextSample, VisionTokens, collate, expand_markers
from lockstep.data.images import ImageProcessorConfig
from lockstep.data.shapes import shape_samples
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config

# 64x64 images, 8-pixel patches: an 8x8 patch grid, 16 image tokens (the debug tower's 8x8 position grid)
PROCESSOR = ImageProcessorConfig(patch_size=8, min_pixels=1024, max_pixels=64 * 64)


def debug_model(flavor: str = "debug"):
    cfg = model_config("qwen3_vl", flavor)
    return build_model(cfg, seed=0), VisionTokens.of(cfg)


def test_collate_mixes_text_only_and_image_samples():
    cfg = model_config("qwen3_vl", "debug")
    ids = VisionTokens.of(cfg, marker=7)
    image = shape_samples(1, marker=7)[0]
    batch = collate([image, ImageTextSample([1, 2, 3])], ids, PROCESSOR, pad_id=0)
    assert batch.grid_thw.tolist() == [[1, 8, 8]] and batch.pixel_values.shape == (64, 3 * 2 * 8 * 8)
    row = batch.tokens[0].tolist()
    assert row[:18] == [ids.vision_start_token_id] + [ids.image_token_id] * 16 + [ids.vision_end_token_id]
    assert batch.tokens.shape == (2, 22) and batch.tokens[1].tolist() == [1, 2, 3] + [0] * 19
    # image placeholders and padding are never targets; the text after the image is
    assert (batch.targets[0, :16] == IGNORE).all() and batch.targets[0, 16] == ids.vision_end_token_id
    assert batch.targets[1].tolist()[:3] == [2, 3, IGNORE]
    with pytest.raises(ValueError, match=r"samples\[0\].*1 image marker"):
        collate([ImageTextSample([7, 1], [])], ids, PROCESSOR, pad_id=0)
    with pytest.raises(ValueError, match="2 image marker"):
        expand_markers([7, 7], [4], ids)


def test_tiny_qwen3_vl_learns_shape_captions():
    torch.manual_seed(0)
    model, ids = debug_model()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.0)
    samples = shape_samples(60, marker=ids.image_token_id, seed=1)
    losses = []
    for step in range(15):
        batch = collate(samples[(step * 6) % 60:(step * 6) % 60 + 6], ids, PROCESSOR, pad_id=0)
        logits = model(batch.tokens, **batch.model_inputs())
        loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"shape captions: loss {first:.3f} -> {last:.3f} in {len(losses)} steps")
    assert last < 0.5 * first
    assert all(g.grad is not None for g in model.visual.parameters())  # the tower is trained too


def test_moe_flavor_trains_a_step():
    model, ids = debug_model("debug-moe")
    batch = collate(shape_samples(2, marker=ids.image_token_id), ids, PROCESSOR, pad_id=0)
    logits = model(batch.tokens, **batch.model_inputs())
    F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE).backward()
    assert model.visual.merger.linear_fc2.weight.grad.abs().sum() > 0
    assert dataclasses.is_dataclass(model.config.vision)


def test_flavors_build_and_lockstep_dir_round_trip(tmp_path):
    from lockstep.models.hf.io import load_lockstep_dir, save_lockstep_dir
    from lockstep.models.registry import get_model_spec

    flavors = set(get_model_spec("qwen3_vl").flavors)
    assert flavors == {"debug", "debug-moe", "tiny", "tiny-moe", "2B", "8B", "30B-A3B"}
    for flavor in flavors:
        model_config("qwen3_vl", flavor).validate()
    model, _ = debug_model("debug-moe")
    save_lockstep_dir(model, tmp_path)
    again = load_lockstep_dir(tmp_path)
    assert again.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_packed_loader_mixes_text_and_images_and_resumes():
    from lockstep.data.image_samples import ImageTextLoader, pack
    from lockstep.models.common.mrope import mrope_positions

    cfg = model_config("qwen3_vl", "debug")
    ids = VisionTokens.of(cfg, marker=7)
    samples = shape_samples(6, marker=7) + [ImageTextSample([1, 2, 3, 4]) for _ in range(4)]
    batch = pack(samples[:2] + samples[6:8] + samples[2:3], ids, PROCESSOR, pad_id=0, seq_len=48)
    # rows: [image sample 22 tokens + image sample 22] [text 4 + text 4 + image sample 22]
    assert batch.tokens.shape == (2, 48) and batch.grid_thw.shape == (3, 3)
    assert (batch.tokens == ids.image_token_id).sum().item() == 3 * 16
    positions, _ = mrope_positions(batch.tokens, batch.grid_thw, ids.image_token_id, 2)  # images line up
    assert positions.shape == (3, 2, 48)
    loader = ImageTextLoader(samples, ids, PROCESSOR, seq_len=64, batch_samples=3, seed=1)
    first = [next(loader) for _ in range(2)]
    state = loader.state_dict()
    after = next(loader)
    again = ImageTextLoader(samples, ids, PROCESSOR, seq_len=64, batch_samples=3, seed=1)
    again.load_state_dict(state)
    resumed = next(again)
    assert torch.equal(resumed.tokens, after.tokens) and torch.equal(resumed.targets, after.targets)
    assert not torch.equal(first[0].tokens, first[1].tokens)
    with pytest.raises(ValueError, match="seq_len=16"):
        pack(samples[:1], ids, PROCESSOR, pad_id=0, seq_len=16)


def test_config_errors_name_the_field():
    from lockstep.config.base import ConfigError
    from lockstep.models.common.mrope import MRopeConfig

    cfg = model_config("qwen3_vl", "debug")
    bad = [
        (dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, num_position_embeddings=60)),
         "model.vision.num_position_embeddings"),
        (dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, deepstack_layers=[0, 5])),
         "model.vision.deepstack_layers"),
        (dataclasses.replace(cfg, image_token_id=cfg.vocab_size), "model.image_token_id"),
        (dataclasses.replace(cfg, rope=MRopeConfig(mrope_section=[2, 3])), "model.rope.mrope_section"),
        (dataclasses.replace(cfg, rope=MRopeConfig(mrope_section=[4, 3, 3])), "model.rope.mrope_section"),
    ]
    for config, field in bad:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            build_model(config)
