"""RL with images: the ``shape_count`` environment, ``score_logprobs`` / the policy objective with image
inputs (== the model's own forward on the same images and tokens), batch-invariant scoring with images,
rollout prompts with image placeholders, and the ``rl-qwen3-vl-shapes`` recipe end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lockstep import numerics
from lockstep.config.base import ConfigError
from lockstep.data.image_mix import processor_for
from lockstep.data.image_samples import VisionTokens, expand_markers
from lockstep.data.images import preprocess_images
from lockstep.data.shapes import draw_shape
from lockstep.generate.sampling import token_logprobs
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.rl.envs import get_environment
from lockstep.rl.scoring import score_logprobs


@pytest.fixture(autouse=True)
def _mode_off_after():
    yield
    numerics.set_batch_invariant(False)


@pytest.fixture(scope="module")
def model():
    return build_model(model_config("qwen3_vl", "debug"), seed=0).eval()


def _episode(model, sizes, text_len, response_len, seed):
    """(prompt + response ids, prompt length, images) with one image per entry of ``sizes`` before the text."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    images = None
    block: list[int] = []
    if sizes:
        processor = processor_for(model.config)
        processed = preprocess_images([draw_shape("circle", (200, 30, 30), s, rng) for s in sizes], processor)
        ids = VisionTokens.of(model.config)
        block = expand_markers([ids.marker] * len(sizes), processed.tokens_per_image(processor.merge_size), ids)
        images = (torch.from_numpy(processed.pixel_values), torch.from_numpy(processed.grid_thw))
    text = torch.randint(0, 4000, (text_len + response_len,), generator=g).tolist()
    return block + text, len(block) + text_len, images


def _batch(model):
    """Two image episodes (images of different sizes, one with two images) and a text-only one."""
    eps = [_episode(model, [64], 5, 6, 0), _episode(model, [], 7, 4, 1), _episode(model, [48, 32], 3, 5, 2)]
    return [e[0] for e in eps], [e[1] for e in eps], [e[2] for e in eps]


def _forward_scores(model, seqs, prompts, images):
    """log-probs from ``model(tokens, pixel_values=, grid_thw=)`` on the right-padded batch."""
    width = max(map(len, seqs))
    tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    pv = torch.cat([im[0] for im in images if im is not None])
    grid = torch.cat([im[1] for im in images if im is not None])
    logits = model(tokens, pixel_values=pv, grid_thw=grid)
    return [token_logprobs(logits[i, p - 1:len(s) - 1], tokens[i, p:len(s)]) for i, (s, p) in
            enumerate(zip(seqs, prompts))]


class _NoTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [1, 2, 3]


def test_shape_count_env_is_deterministic_and_rewards_the_count():
    env = get_environment("shape_count", shaping=0.2)
    task, again = env.reset(7), env.reset(7)
    assert np.array_equal(task.images[0], again.images[0]) and task.answer == again.answer
    assert task.images[0].shape == (64, 64, 3) and task.images[0].dtype == np.uint8
    counts = {int(env.reset(s).answer) for s in range(30)}
    assert counts == {1, 2, 3}
    assert not np.array_equal(env.reset(8).images[0], task.images[0])
    count = task.data["count"]
    words = ["zero", "one", "two", "three", "four"]
    assert env.step(task, f"I see {count}").reward == 1.0
    assert env.step(task, f"There are {words[count]}.").reward == 1.0
    assert env.step(task, f"{count} or rather {count + 1}").reward < 0.2  # the last number counts
    near = words[count][:-1]  # "thre": no count, but close to the count's word
    assert 0 < env.step(task, near).reward < 0.2  # shaping: similarity to the count's word, below any exact answer
    exact_only = get_environment("shape_count")
    assert exact_only.step(task, near).reward == 0.0 and exact_only.step(task, f"{count}.0").reward == 1.0
    # the picture holds that many red/green/blue blobs more than the distractors: circles are drawn first,
    # each in its own grid cell, so at least `count` cells are coloured
    coloured = (np.abs(task.images[0].astype(int) - 128).sum(-1) > 0)
    cells = {(y * 3 // 64, x * 3 // 64) for y, x in zip(*np.nonzero(coloured))}
    assert len(cells) >= count
    with pytest.raises(ConfigError, match=r"^environment\[shape_count\]\.max_count"):
        get_environment("shape_count", max_count=8, distractors=2)
    from lockstep.rl.sft import sft_example

    from lockstep.generate import Engine, EngineConfig
    from lockstep.rl.rollout import Rollout

    from lockstep.data.image_mix import require_vision_tower

    engine = Engine(build_model(model_config("qwen3", "debug")), None, EngineConfig(cache_memory_mb=4))
    with pytest.raises(ConfigError, match=r"^rollout: task 'shape_count#7' has images: image samples need a vision"):
        Rollout(engine, tokenizer=_NoTokenizer())._start(env, 7, 0, 0, 0)
    require_vision_tower(model_config("kimi_k25", "debug"), "rollout")  # tests/models/kimi_k25/test_kimi_k25_rl.py
    with pytest.raises(ConfigError, match=r"^sft\.steps: the SFT warm-up trains on text prompts only"):
        sft_example(task, " {answer}", None, None, False, None)


def test_score_logprobs_with_images_equals_the_model_forward(model):
    seqs, prompts, images = _batch(model)
    with torch.no_grad():
        want = _forward_scores(model, seqs, prompts, images)
        full = score_logprobs(model, seqs, prompts, images=images, full_forward=True)
        trunk = score_logprobs(model, seqs, prompts, images=images)
        text_only = score_logprobs(model, seqs, prompts)  # the images change the scores
    for w, f, t in zip(want, full, trunk):
        assert torch.equal(w, f)  # the same forward: bitwise
        # the head over the response rows only vs every row: a different GEMM shape, fp32 rounding only
        torch.testing.assert_close(t, w, rtol=0, atol=1e-5)
    assert not torch.allclose(text_only[0], want[0], atol=1e-3)
    with pytest.raises(ConfigError, match=r"score_logprobs: images\[0\]: sequence 0 holds 16 image placeholders, "
                                          r"its images take 0"):
        score_logprobs(model, seqs, prompts, images=[None, None, images[2]])
    text_model = build_model(model_config("llama3", "debug"))
    with pytest.raises(ConfigError, match="has no vision tower"):
        score_logprobs(text_model, [[1, 2, 3]], [1], images=[images[0]])


def test_batch_invariant_scores_with_images_do_not_depend_on_the_batch(model):
    seqs, prompts, images = _batch(model)
    numerics.set_batch_invariant(True)
    with torch.no_grad():
        batched = score_logprobs(model, seqs, prompts, images=images)
        full = score_logprobs(model, seqs, prompts, images=images, full_forward=True)
        for i in range(3):
            [alone] = score_logprobs(model, [seqs[i]], [prompts[i]], images=[images[i]])
            assert torch.equal(batched[i], alone) and torch.equal(full[i], alone), i


def test_policy_objective_with_images_trains_the_tower():
    from lockstep.rl.losses import LossConfig
    from lockstep.rl.objective import PolicyBatch, PolicyObjective, pad_rows

    model = build_model(model_config("qwen3_vl", "debug"), seed=0)
    seqs, prompts, images = _batch(model)
    lengths = [len(s) - p for s, p in zip(seqs, prompts)]
    width = max(lengths)
    mask = pad_rows([torch.ones(n) for n in lengths], width)
    with torch.no_grad():
        gen = pad_rows(score_logprobs(model, seqs, prompts, images=images), width)
    loss = LossConfig(kind="grpo").build(max_response_length=width)
    batch = PolicyBatch(seqs, prompts, [1.0] * 3, mask, gen, torch.tensor([1.0, -0.5, -0.5]),
                        torch.ones(3, dtype=torch.bool), 3.0, images=images)
    value, report = PolicyObjective(loss)(model, batch)
    value.backward()
    for got, want in zip(report.logprobs, gen):
        assert torch.equal(got, want[:got.numel()])  # the trainer's scores: the same function, same bits
    assert model.visual.merger.linear_fc2.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.visual.parameters())


def test_rollout_sends_the_images_to_the_engine_and_keeps_them():
    """An image question's episode: the prompt holds the image's placeholder run before the text, the
    engine sampled with the image (its log-probs == the trainer's scores with the images, bitwise in
    batch-invariant mode, and != the scores without them), and the episode keeps the pixels."""
    from lockstep.data.config import DataConfig
    from lockstep.data.tokenizer import Tokenizer
    from lockstep.generate import Engine, EngineConfig, SamplingParams
    from lockstep.recipes.vision import shakespeare_vl_model
    from lockstep.rl.rollout import Rollout, RolloutConfig

    numerics.set_batch_invariant(True)
    policy = build_model(shakespeare_vl_model(), seed=0).eval()
    tokenizer = Tokenizer.from_file(DataConfig().resolved_tokenizer_path())
    engine = Engine(policy, tokenizer, EngineConfig(cache_memory_mb=16, max_batch_size=4,
                                                          image_min_pixels=64 * 64))
    rollout = Rollout(engine, RolloutConfig(group_size=2, sampling=SamplingParams(max_new_tokens=4)))
    episodes = rollout.run(get_environment("shape_count"), [3])
    ids = VisionTokens.of(policy.config)
    for ep in episodes:
        pixels, grid = ep.images
        assert grid.tolist() == [[1, 8, 8]] and pixels.shape == (64, 3 * 2 * 8 * 8)
        assert ep.token_ids[:18] == [ids.vision_start_token_id] + [ids.image_token_id] * 16 + [ids.vision_end_token_id]
        assert ep.token_ids.count(ids.image_token_id) == 16
    seqs, prompts = [ep.token_ids for ep in episodes], [ep.prompt_len for ep in episodes]
    with torch.no_grad():
        scored = score_logprobs(policy, seqs, prompts, images=[ep.images for ep in episodes])
        blind = score_logprobs(policy, seqs, prompts)
    for ep, s, b in zip(episodes, scored, blind):
        generated = torch.tensor(ep.logprobs[ep.prompt_len:])
        assert torch.equal(generated, s)
        assert not torch.equal(generated, b)  # the engine saw the image


def test_rl_qwen3_vl_shapes_recipe_end_to_end(tmp_path):
    """``lockstep rl --recipe rl-qwen3-vl-shapes`` colocated: every step's groups have reward variance, the
    policy gradient reaches the vision tower, generator == trainer log-probabilities (batch-invariant)."""
    from safetensors.torch import load_file

    from lockstep.cli_rl import resolve_rl_config
    from lockstep.rl.loop import run_rl

    config, _ = resolve_rl_config(["--recipe", "rl-qwen3-vl-shapes", "--run-dir", str(tmp_path / "run"),
                                   "--workers.generators", "0", "--steps", "2", "--output.no-progress"])
    result = run_rl(config)
    assert [r["step"] for r in result.steps] == [1, 2]
    for r in result.steps:
        assert r["reward/std"] > 0 and r["grad_norm"] > 0 and r["logprob_diff/max"] == 0.0, r
    trained = load_file(result.run_dir / "model.safetensors")
    initial = build_model(config.model, seed=config.seed).state_dict()
    assert not torch.equal(trained["visual.merger.linear_fc2.weight"], initial["visual.merger.linear_fc2.weight"])
