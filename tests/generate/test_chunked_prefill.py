"""Chunked prefill (EngineConfig.prefill_chunk, lockstep.generate.prefill): the same tokens as one-shot
prefill, logits within float rounding, and no forward wider than the chunk."""

from __future__ import annotations

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.generate import EngineConfig, Request, SamplingParams

from .conftest import FAMILIES, engine_for, prompts, record_logits, tiny_model

#: shorter than, equal to, and several times the chunk of 8; 29 ends mid-chunk, 17 on a chunk's first column
LENGTHS = [3, 8, 29, 17]


def requests(new: int = 6) -> list[Request]:
    return [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=new, temperature=0.0))
            for p in prompts(LENGTHS)]


def run(model, **config):
    engine = engine_for(model, max_batch_size=4, **config)
    widths: list[int] = []
    trunk = engine.runner.trunk

    def recording(tokens, positions=None, cache=None):
        widths.append(tokens.shape[1])
        return trunk(tokens, positions, cache)

    engine.runner.trunk = recording
    seen = record_logits(engine)
    results = engine.generate(requests())
    del engine.runner.trunk
    return results, seen, widths


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3_5"])
def test_chunked_prefill_matches_one_shot(family):
    model = tiny_model(family)
    whole, whole_logits, whole_widths = run(model)
    assert max(whole_widths) == max(LENGTHS)
    chunk = 8
    chunked, chunked_logits, widths = run(model, prefill_chunk=chunk)
    assert [r.token_ids for r in chunked] == [r.token_ids for r in whole]
    assert max(widths) == chunk  # activation memory: no forward wider than the chunk
    for seq_id, rows in whole_logits.items():
        # fp32: a chunk's attention reduces over the cached context instead of the whole prompt;
        # same math, other summation order (logits are O(5): 1e-4 is ~30 ulp)
        torch.testing.assert_close(torch.stack(chunked_logits[seq_id]), torch.stack(rows), rtol=0, atol=1e-4)


def test_chunked_prefill_refusals():
    with pytest.raises(ConfigError, match=r"^engine.prefill_chunk: chunked prefill does not support sliding-window"):
        engine_for(tiny_model("gpt_oss"), prefill_chunk=8)
    with pytest.raises(ConfigError, match=r"^engine.prefill_chunk: must be an integer >= 0"):
        EngineConfig(prefill_chunk=-1).validate()
