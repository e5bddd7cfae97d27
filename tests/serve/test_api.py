"""``lockstep serve``'s OpenAI API with the official ``openai`` client against a live server on
127.0.0.1: completions and chat, streaming and not, equal to the lockstep Engine run in-process on
a second copy of the model (token ids and log-probabilities, exactly: same engine, same
configuration, one request at a time), stop strings, seeds, concurrency with batching."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import pytest

from lockstep.generate import Request, SamplingParams
from tests.serve.conftest import MODEL_NAME, reference_engine

PROMPT = "To be, or not to be"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "whether 'tis nobler"}]


@pytest.fixture(scope="module")
def reference(model_dir):
    return reference_engine(model_dir)


def engine_run(reference, prompt_ids: list[int], **sampling):
    engine, _ = reference
    [result] = engine.generate([Request(prompt_ids=prompt_ids, sampling=SamplingParams(**sampling))])
    return result


def stats(server) -> dict:
    return json.loads(urllib.request.urlopen(server.base_url + "/stats").read())


def chat_ids(reference, messages) -> list[int]:
    _, source = reference
    return source.chat_template.encode(source.tokenizer, messages)


def test_models_lists_the_served_model(client):
    [model] = client.models.list().data
    assert model.id == MODEL_NAME


def test_completion_greedy_is_the_engine(client, reference):
    _, source = reference
    ids = source.tokenizer.encode(PROMPT)
    want = engine_run(reference, ids, max_new_tokens=12, temperature=0)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.token_ids == want.token_ids
    assert out.prompt_token_ids == ids
    assert choice.text == want.text and choice.finish_reason == want.finish_reason == "length"
    # exact: the server's floats are the engine's fp32 values, round-tripped through JSON
    assert choice.logprobs.token_logprobs == want.logprobs
    assert len(choice.logprobs.top_logprobs) == 12
    for top, lp in zip(choice.logprobs.top_logprobs, want.logprobs):
        assert max(top.values()) == lp  # greedy: the chosen token is the most likely one
    usage = out.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 12, len(ids) + 12)


def test_completion_from_token_ids(client, reference):
    ids = [5, 77, 120, 33]
    want = engine_run(reference, ids, max_new_tokens=6, temperature=0)
    out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == want.token_ids


def test_chat_greedy_is_the_engine_with_the_chat_template(client, reference):
    ids = chat_ids(reference, MESSAGES)
    want = engine_run(reference, ids, max_new_tokens=10, temperature=0)
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert out.prompt_token_ids == ids
    assert choice.token_ids == want.token_ids
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert [c.logprob for c in choice.logprobs.content] == want.logprobs
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob


def test_streaming_completion_concatenates_to_the_whole_response(client, reference):
    _, source = reference
    want = engine_run(reference, source.tokenizer.encode(PROMPT), max_new_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, logprobs=1, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    *token_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in token_chunks) == want.text
    assert [t for c in token_chunks for t in c.choices[0].token_ids] == want.token_ids
    assert [lp for c in token_chunks for lp in c.choices[0].logprobs.token_logprobs] == want.logprobs
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10


def test_streaming_chat(client, reference):
    want = engine_run(reference, chat_ids(reference, MESSAGES), max_new_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, logprobs=True, top_logprobs=1))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    entries = [e for c in chunks[1:] for e in c.choices[0].logprobs.content]  # one token per chunk with logprobs
    assert [e.logprob for e in entries] == want.logprobs
    assert all(e.top_logprobs[0].logprob == e.logprob for e in entries)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_stop_string_cuts_the_text_and_is_the_stop_reason(client, reference):
    _, source = reference
    ids = source.tokenizer.encode(PROMPT)
    free = engine_run(reference, ids, max_new_tokens=16, temperature=0)
    stop = free.text[5:7]  # two characters the model writes: the text must end before their first occurrence
    assert len(stop) == 2
    want_text = free.text[:free.text.find(stop)]
    for stream in (False, True):
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                        stream=stream)
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == want_text
        last = chunks[-1].choices[0]
        assert last.finish_reason == "stop" and last.stop_reason == stop


def test_seeded_sampling_replays_and_is_the_engine(client, reference):
    _, source = reference
    ids = source.tokenizer.encode(PROMPT)
    want = engine_run(reference, ids, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    outs = [client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95,
                                      seed=1234, extra_body={"return_token_ids": True}) for _ in range(2)]
    assert outs[0].choices[0].token_ids == outs[1].choices[0].token_ids == want.token_ids
    other = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95,
                                      seed=4321, extra_body={"return_token_ids": True})
    assert other.choices[0].token_ids != want.token_ids  # the seed matters (12 draws from ~320 tokens)


def test_concurrent_requests_all_finish_and_are_batched(client, server, reference):
    _, source = reference
    before = stats(server)
    prompts = [f"{PROMPT} {i}" for i in range(8)]

    def one(prompt: str):
        return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"return_token_ids": True})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, prompts))
    after = stats(server)
    assert all(len(o.choices[0].token_ids) == 24 and o.choices[0].finish_reason == "length" for o in outs)
    assert after["finished"] - before["finished"] == 8
    assert after["batched_steps"] > before["batched_steps"]  # an engine step ran more than one request
    assert after["max_active"] >= 2 and after["in_flight"] == 0
    # batched rows may round differently from a lone request (the engine is not batch-invariant by
    # default), so no token equality here; each answer's text is its own tokens' text
    for out in outs:
        assert out.choices[0].text == source.tokenizer.decode(out.choices[0].token_ids)


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(client, reference):
    # the default (1024) is capped by the rest of the tiny model's 512-token context
    ids = chat_ids(reference, MESSAGES)
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 512 - len(ids)
