"""An engine over a model that is being trained sees every optimizer step.

lockstep's AdamW is torch's fused kernel, which writes the parameters without moving their version
counters (torch 2.13); the engine's bf16 cast copy and its packed weights decide staleness by those
counters, so ``AdamWConfig.build`` moves them after each step. Without that, the RL loop's
colocated generator sampled from stale weights (found by the RL resume test).
"""

from __future__ import annotations

import pytest
import torch

from lockstep.generate import Request, SamplingParams
from lockstep.train.optim import AdamWConfig

from .conftest import engine_for, prompts, tiny_model


def test_adamw_steps_move_version_counters():
    model = tiny_model("llama3")
    optimizer = AdamWConfig(lr=1e-2).build(model)
    model(torch.tensor([prompts([5])[0]])).float().mean().backward()
    before = [p._version for p in model.parameters()]
    optimizer.step()
    assert all(p._version > v for p, v in zip(model.parameters(), before))


@pytest.mark.parametrize("engine_config", [{}, {"weights_dtype": "bfloat16"}], ids=["own-weights", "bf16-copy"])
def test_engine_generates_from_the_stepped_weights(engine_config):
    model = tiny_model("llama3")
    optimizer = AdamWConfig(lr=5e-2).build(model)
    engine = engine_for(model, **engine_config)
    reqs = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=6, temperature=0)) for p in prompts([4, 7])]
    first = engine.generate(reqs)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.tensor([prompts([9])[0]])).float().logsumexp(-1).mean().backward()
        optimizer.step()
    after = engine.generate(reqs)
    twin = tiny_model("llama3")  # new modules: packs and casts made from the stepped weights
    twin.load_state_dict(model.state_dict())
    fresh = engine_for(twin, **engine_config).generate(reqs)
    assert [(r.token_ids, r.logprobs) for r in after] == [(r.token_ids, r.logprobs) for r in fresh]
    assert [r.logprobs for r in after] != [r.logprobs for r in first]
