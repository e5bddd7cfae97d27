"""RL with images for Kimi K2.5: a ``shape_count`` rollout through the engine (the picture preprocessed by Kimi's
processor, its placeholder run before the text) and the trainer's ``score_logprobs`` with the episode's images ==
the engine's log-probabilities, bitwise in batch-invariant mode (as tests/rl/test_vision_rl.py for Qwen3-VL)."""

from __future__ import annotations

import pytest
import torch

from lockstep import numerics
from lockstep.data.image_samples import VisionTokens
from lockstep.models.common.transformer import build_model
from lockstep.recipes.vision import shakespeare_vl_model
from lockstep.rl.envs import get_environment
from lockstep.rl.scoring import score_logprobs


@pytest.fixture(autouse=True)
def _mode_off_after():
    yield
    numerics.set_batch_invariant(False)


def test_rollout_images_and_scores_equal_the_engine():
    from lockstep.data.config import DataConfig
    from lockstep.data.tokenizer import Tokenizer
    from lockstep.generate import Engine, EngineConfig, SamplingParams
    from lockstep.rl.rollout import Rollout, RolloutConfig

    numerics.set_batch_invariant(True)
    policy = build_model(shakespeare_vl_model(family="kimi_k25"), seed=0).eval()
    tokenizer = Tokenizer.from_file(DataConfig().resolved_tokenizer_path())
    engine = Engine(policy, tokenizer, EngineConfig(cache_memory_mb=16, max_batch_size=4))
    rollout = Rollout(engine, RolloutConfig(group_size=2, sampling=SamplingParams(max_new_tokens=4)))
    episodes = rollout.run(get_environment("shape_count"), [3])
    ids = VisionTokens.of(policy.config)
    for ep in episodes:
        pixels, grid = ep.images
        # a 64x64 picture, 8-pixel patches, never resized: an 8x8 grid of raster patch rows, 16 merged tokens
        assert grid.tolist() == [[1, 8, 8]] and pixels.shape == (64, 3 * 8 * 8)
        assert ep.token_ids[:18] == [ids.vision_start_token_id] + [ids.image_token_id] * 16 + [ids.vision_end_token_id]
    seqs, prompts = [ep.token_ids for ep in episodes], [ep.prompt_len for ep in episodes]
    with torch.no_grad():
        scored = score_logprobs(policy, seqs, prompts, images=[ep.images for ep in episodes])
        full = score_logprobs(policy, seqs, prompts, images=[ep.images for ep in episodes], full_forward=True)
        blind = score_logprobs(policy, seqs, prompts)
    for ep, s, f, b in zip(episodes, scored, full, blind):
        generated = torch.tensor(ep.logprobs[ep.prompt_len:])
        assert torch.equal(generated, s) and torch.equal(generated, f)
        assert not torch.equal(generated, b)  # the engine saw the image
