"""Bad input fails before any work with a ConfigError naming the field."""

from __future__ import annotations

import pytest

from lockstep.config.base import ConfigError
from lockstep.generate import Engine, EngineConfig, Request, SamplingParams

from .conftest import FakeTokenizer, engine_for, tiny_model


@pytest.fixture(scope="module")
def engine():
    return engine_for(tiny_model("llama3"), num_blocks=4, block_size=4)  # 16 tokens of cache


@pytest.mark.parametrize("request_kwargs,field", [
    (dict(prompt_ids=[]), r"Request\.prompt_ids: the prompt is empty"),
    (dict(), r"Request\.prompt_ids: no prompt given"),
    (dict(prompt="abc"), r"Request\.prompt: a text prompt needs an Engine with a tokenizer"),
    (dict(prompt="abc", prompt_ids=[1]), r"Request: give prompt_ids or prompt, not both"),
    (dict(prompt_ids=[1, 256]), r"Request\.prompt_ids: token ids \[256\] are outside the vocabulary \[0, 256\)"),
    (dict(prompt_ids=[-1, 2]), r"Request\.prompt_ids: token ids \[-1\] are outside the vocabulary"),
    (dict(prompt_ids=[1] * 17), r"Request\.prompt_ids: the prompt has 17 tokens, longer than the KV cache budget"),
    (dict(prompt_ids=[1], sampling=SamplingParams(temperature=-0.5)), r"sampling\.temperature: must be >= 0"),
    (dict(prompt_ids=[1], sampling=SamplingParams(top_p=0.0)), r"sampling\.top_p: must be in \(0, 1\]"),
    (dict(prompt_ids=[1], sampling=SamplingParams(top_p=1.5)), r"sampling\.top_p: must be in \(0, 1\]"),
    (dict(prompt_ids=[1], sampling=SamplingParams(top_k=-1)), r"sampling\.top_k: must be an integer >= 0"),
    (dict(prompt_ids=[1], sampling=SamplingParams(max_new_tokens=0)), r"sampling\.max_new_tokens"),
    (dict(prompt_ids=[1], sampling=SamplingParams(seed=1.5)), r"sampling\.seed"),
    (dict(prompt_ids=[1], sampling=SamplingParams(stop_token_ids=[300])),
     r"sampling\.stop_token_ids: \[300\] are outside"),
    (dict(prompt_ids=[1], sampling=SamplingParams(stop_token_ids=[-2])), r"sampling\.stop_token_ids"),
    (dict(prompt_ids=[1], sampling=SamplingParams(stop=["x"])),
     r"sampling\.stop: stop strings need an Engine with a tokenizer"),
    (dict(prompt_ids=[1], sampling=SamplingParams(stop=[""])), r"sampling\.stop: must be non-empty strings"),
    (dict(prompt_ids=[1], sampling={"temperature": 0}), r"Request\.sampling: must be a SamplingParams"),
])
def test_bad_requests_are_refused_naming_the_field(engine, request_kwargs, field):
    with pytest.raises(ConfigError, match=field):
        engine.add_request(Request(**request_kwargs))
    assert not engine.has_unfinished


def test_a_batch_with_one_bad_request_queues_none(engine):
    good = Request(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2))
    with pytest.raises(ConfigError, match="sampling.top_p"):
        engine.generate([good, Request(prompt_ids=[1], sampling=SamplingParams(top_p=2.0))])
    assert not engine.has_unfinished and engine.cache.allocator.num_free == 4


def test_prompt_longer_than_the_model_context():
    model = tiny_model("llama3", max_seq_len=16)
    engine = engine_for(model)
    with pytest.raises(ConfigError, match=r"the prompt has 17 tokens, longer than the model's context "
                                          r"\(model\.max_seq_len=16\)"):
        engine.add_request(Request(prompt_ids=[1] * 17))


@pytest.mark.parametrize("config,field", [
    (dict(block_size=0), "engine.block_size"),
    (dict(cache_memory_mb=-1.0), "engine.cache_memory_mb"),
    (dict(num_blocks=-1), "engine.num_blocks"),
    (dict(max_batch_size=0), "engine.max_batch_size"),
    (dict(max_prefill_tokens=0), "engine.max_prefill_tokens"),
    (dict(compile_decode="cudagraphs"), "engine.compile_decode"),
])
def test_bad_engine_config_is_refused_naming_the_field(config, field):
    with pytest.raises(ConfigError, match=field):
        Engine(tiny_model("llama3"), None, EngineConfig(**config))


def test_text_needs_a_tokenizer_and_works_with_one():
    engine = engine_for(tiny_model("llama3"), tokenizer=FakeTokenizer())
    [r] = engine.generate([Request(prompt="bcd", sampling=SamplingParams(max_new_tokens=2, temperature=0,
                                                                          ignore_eos=True))])
    assert r.prompt_ids == [1, 2, 3] and len(r.token_ids) == 2


def test_engine_needs_a_lockstep_transformer():
    import torch

    with pytest.raises(TypeError, match="Engine needs a lockstep Transformer"):
        Engine(torch.nn.Linear(2, 2))


def test_compiling_fp32_grouped_mm_experts_is_refused():
    """torch._grouped_mm's compile-time kernel takes bf16 only: say so before the first step."""
    with pytest.raises(ConfigError, match=r"engine\.compile_decode: layers\.0\.feed_forward\.experts computes its "
                                          r"experts with torch\._grouped_mm in torch\.float32"):
        engine_for(tiny_model("qwen3_moe"), compile_decode="aot_eager")
