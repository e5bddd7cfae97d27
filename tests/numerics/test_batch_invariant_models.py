"""Batch-invariant mode on whole models: trainer scoring and generator log-probabilities, bitwise.

(1) ``score_logprobs`` of a sequence alone equals its scores inside batches of other sizes, orders
and lengths (hypothesis draws the batches). (2) The engine's log-probabilities, recorded while it
samples (mixed prompt lengths, more requests than batch slots so sequences join and leave), equal
``score_logprobs`` of the finished sequences. Both with ``torch.equal``, fp32 and bf16, for a dense
GQA (llama3), a q/k-norm (qwen3), a MoE (qwen3_moe), an MLA + MoE (deepseek_v3) family and
GPT-OSS (attention sinks, sliding windows shorter than the sequences). With the
mode off the same comparisons differ, so these tests can fail. The same comparisons over drawn
model shapes (and at lower kernel paths) are in ``test_batch_invariant_shapes.py``.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep import numerics
from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
from lockstep.models.common.transformer import build_model
from lockstep.recipes import get_recipe
from lockstep.rl import score_logprobs

FAMILIES = ["debug", "debug-qwen3", "debug-moe", "debug-deepseek", "debug-gptoss"]
DTYPES = [torch.float32, torch.bfloat16]
LENGTHS = [5, 17, 40, 33, 64, 9, 2, 50]
PROMPTS = [2, 9, 20, 1, 30, 4, 1, 25]


@pytest.fixture(autouse=True)
def _mode_off_after():
    yield
    numerics.set_batch_invariant(False)


_MODELS: dict = {}


def _model(recipe: str, dtype: torch.dtype):
    key = (recipe, dtype)
    if key not in _MODELS:
        _MODELS[key] = build_model(get_recipe(recipe).config().model, seed=0).to(dtype).eval()
    return _MODELS[key]


def _sequences(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _score(model, indices, seqs):
    with torch.no_grad():
        return score_logprobs(model, [seqs[i] for i in indices], [PROMPTS[i] for i in indices])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("recipe", FAMILIES)
@settings(max_examples=4, deadline=None)
@given(batch=st.lists(st.integers(0, len(LENGTHS) - 1), min_size=1, max_size=6, unique=True))
def test_trainer_scores_do_not_depend_on_the_batch(recipe, dtype, batch):
    numerics.set_batch_invariant(True)
    model = _model(recipe, dtype)
    seqs = _sequences(model.config.vocab_size)
    for i, scores in zip(batch, _score(model, batch, seqs)):
        [alone] = _score(model, [i], seqs)
        assert torch.equal(scores, alone), (recipe, dtype, batch, i)


def _generate_and_score(recipe: str, dtype: torch.dtype, temperature: float, n_requests: int = 5):
    """``n_requests`` prompts of mixed lengths through 2 batch slots: requests join as others finish."""
    model = _model(recipe, dtype)
    seqs = _sequences(model.config.vocab_size)[:n_requests]
    engine = Engine(model, None, EngineConfig(cache_memory_mb=32, max_batch_size=2))
    requests = [Request(prompt_ids=s[:p], sampling=SamplingParams(max_new_tokens=3 + 2 * i, temperature=temperature,
                                                                    seed=i))
                for i, (s, p) in enumerate(zip(seqs, PROMPTS))]
    results = engine.generate(requests)
    finished = [list(r.prompt_ids) + list(out.token_ids) for r, out in zip(requests, results)]
    with torch.no_grad():
        scored = score_logprobs(model, finished, PROMPTS[:n_requests],
                                temperature=temperature if temperature > 0 else 1.0)
    return [torch.tensor(out.logprobs) for out in results], scored


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("recipe", FAMILIES)
def test_generator_logprobs_equal_trainer_logprobs(recipe, dtype):
    numerics.set_batch_invariant(True)
    temperature = 0.0 if dtype == torch.float32 else 0.7  # greedy and sampled, one each per family
    generated, scored = _generate_and_score(recipe, dtype, temperature)
    for i, (g, s) in enumerate(zip(generated, scored)):
        assert torch.equal(g, s), (recipe, dtype, temperature, i, (g - s).abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_with_the_mode_off_the_same_comparisons_differ(dtype):
    numerics.set_batch_invariant(False)
    model = _model("debug", dtype)
    seqs = _sequences(model.config.vocab_size)
    batch = list(range(len(LENGTHS)))
    batched = _score(model, batch, seqs)
    alone = [_score(model, [i], seqs)[0] for i in batch]
    assert any(not torch.equal(a, b) for a, b in zip(alone, batched))
    generated, scored = _generate_and_score("debug", dtype, 0.7, n_requests=len(LENGTHS))
    assert any(not torch.equal(g, s) for g, s in zip(generated, scored))
    # and the mode off is what it was: the configured kernels, not the invariant ones
    assert {m.backend_name for m in model.modules() if hasattr(m, "backend_name")} == {"sdpa"}


def test_switch_context_manager_restores():
    assert not numerics.is_batch_invariant()
    with numerics.batch_invariant():
        assert numerics.is_batch_invariant()
        with numerics.batch_invariant(False):
            assert not numerics.is_batch_invariant()
        assert numerics.is_batch_invariant()
    assert not numerics.is_batch_invariant()


def test_engine_config_switch_overrides_the_process_switch():
    numerics.set_batch_invariant(False)
    model = _model("debug", torch.float32)
    seqs = _sequences(model.config.vocab_size)
    engine = Engine(model, None, EngineConfig(cache_memory_mb=32, max_batch_size=2, batch_invariant=True))
    requests = [Request(prompt_ids=s[:p], sampling=SamplingParams(max_new_tokens=4, temperature=0.0))
                for s, p in zip(seqs[:3], PROMPTS)]
    results = engine.generate(requests)
    assert not numerics.is_batch_invariant()  # restored after each step
    finished = [list(r.prompt_ids) + list(o.token_ids) for r, o in zip(requests, results)]
    with numerics.batch_invariant(), torch.no_grad():
        scored = score_logprobs(model, finished, PROMPTS[:3])
    assert all(torch.equal(torch.tensor(o.logprobs), s) for o, s in zip(results, scored))
