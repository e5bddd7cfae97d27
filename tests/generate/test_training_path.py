"""Generation leaves the training path alone: forward(tokens) (cache=None) is bitwise what it was,
before and after an Engine ran the same model, and equals the pre-cache composition of the blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lockstep.generate import Request, SamplingParams

from .conftest import FAMILIES, engine_for, prompts, tiny_model


def _reference_forward(model, tokens: torch.Tensor) -> torch.Tensor:
    """The trunk as it was before the cache argument existed: blocks called as (x, rope) only."""
    rope = model.rope(torch.arange(tokens.shape[1])[None])
    h = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        h = h + layer.attention(layer.attention_norm(h), rope)
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h))


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_is_bitwise_unchanged_by_an_engine(family):
    changes = {}
    if family == "deepseek_v3":  # aux-loss-free balancing on: a training-mode forward would move the bias
        cfg = tiny_model(family).config
        changes["feed_forward"] = dataclasses.replace(cfg.feed_forward, bias_update_speed=0.01)
    model = tiny_model(family, **changes).train()
    tokens = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.eval()
        before = model(tokens)
        assert torch.equal(before, _reference_forward(model, tokens))
        assert torch.equal(before, model.output(model.trunk(tokens)[2]))
        assert torch.equal(before, model.output(model.trunk(tokens, cache=None)[2]))
    model.train()
    engine = engine_for(model)
    engine.generate([Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=5, seed=0)) for p in prompts([3, 8])])
    assert model.training  # the engine restores the mode it found
    for k, v in model.state_dict().items():  # no weight or buffer (MoE selection bias) moved
        assert torch.equal(v, state[k]), k
    with torch.no_grad():
        model.eval()
        after = model(tokens)
    assert torch.equal(before, after)
    # and training still works on the same model: gradients flow, nothing is an inference tensor
    model.train()
    logits = model(tokens)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    grad = model.tok_embeddings.weight.grad
    assert grad is not None and bool(torch.isfinite(grad).all()) and bool(grad.abs().sum() > 0)
