"""DeepSeek-V4 generation references: greedy decoding by whole-sequence recompute in lockstep equals
transformers' ``generate`` (which runs its own CSA/HCA cache), and what lockstep's engine still refuses
for the family (batch-invariant mode). The engine's cached path: tests/generate/test_deepseek_v4_generate.py."""

from __future__ import annotations

import pytest
import torch

from lockstep.config.base import ConfigError

pytest.importorskip("transformers")
from v4_reference import pair  # noqa: E402

from lockstep.generate import Engine, EngineConfig  # noqa: E402

NEW_TOKENS = 12
#: greedy choices closer than this (fp32 logits agree to ~1e-6) could flip between implementations
MIN_MARGIN = 1e-4


@pytest.fixture(scope="module")
def models():
    model, hf = pair(seed=2)
    with torch.no_grad():  # larger weights: a peaked, non-degenerate next-token distribution
        model.output.weight.mul_(20)
        hf.lm_head.weight.mul_(20)
    return model, hf


def test_engine_refuses_batch_invariant_mode(models):
    model, _ = models
    with pytest.raises(ConfigError, match=r"engine.batch_invariant: not supported by deepseek_v4 .*"
                                          r"'compressed_attention.eager'"):
        Engine(model, None, EngineConfig(cache_memory_mb=4, batch_invariant=True))


@pytest.mark.parametrize("prompt_len", [1, 13])
@torch.no_grad()
def test_greedy_recompute_equals_transformers_generate(models, prompt_len):
    model, hf = models
    prompt = torch.randint(0, 4096, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    want = hf.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True,
                       pad_token_id=0)[0, prompt_len:].tolist()
    tokens = prompt
    for _ in range(NEW_TOKENS):
        logits = model(tokens)[0, -1]
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] > MIN_MARGIN, "near-tie in the greedy choice; change the seed"
        tokens = torch.cat([tokens, logits.argmax().view(1, 1)], dim=1)
    got = tokens[0, prompt_len:].tolist()
    assert len(set(got)) > 1  # not a degenerate model
    assert got == want
