"""Bad requests are 400s in OpenAI's error shape naming the field; overload is a 429 and an engine
that failed or a server shutting down is a 503; a client that leaves a stream frees its slot."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from lockstep.generate import Engine, EngineConfig
from lockstep.serve import BackgroundServer, create_app
from tests.serve.conftest import MODEL_NAME, load

CHAT = [{"role": "user", "content": "hello"}]


def post(server, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.base_url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, "model"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, 10**7]}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "n": 2}, "n"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "seed": 1.5}, "seed"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": 3}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "max_completion_tokens": 10**6}, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * 5000}]},
     "messages"),
])
def test_bad_request_is_a_400_naming_the_field(server, path, body, field):
    status, out = post(server, path, body)
    assert status == 400, out
    error = out["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(field), error["message"]


def test_bad_json_is_a_400(server):
    status, out = post(server, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in out["error"]["message"]


def test_the_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=10**6)
    assert err.value.status_code == 400 and err.value.param == "max_tokens"


def test_image_parts_to_a_text_only_model_are_a_400(client):
    """Refused before the image is even decoded (tests/serve/test_images.py serves a vision-language model)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    content = [{"type": "text", "text": "hi"}, image]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=2)
    assert err.value.param == "messages[0].content[1]"
    assert err.value.body["message"].startswith("messages[0].content[1]: the served model (llama3) takes text only")
    # text parts alone are still one string for the (text-only) chat template
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content[:1]}],
                                         max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


# ---------------------------------------------------------------------------- overload and failure


class GatedEngine:
    """The lockstep Engine, but ``step`` waits for ``gate``, sleeps ``delay`` and raises when ``fail``."""

    def __init__(self, engine: Engine) -> None:
        self.inner, self.gate, self.delay, self.fail = engine, threading.Event(), 0.0, False
        self.tokenizer, self.max_seq_len = engine.tokenizer, engine.max_seq_len
        self.vocab_size, self.eos_id, self.cache = engine.vocab_size, engine.eos_id, engine.cache

    def add_request(self, request):
        return self.inner.add_request(request)

    def abort(self, seq_id):
        return self.inner.abort(seq_id)

    @property
    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished

    def step(self):
        self.gate.wait()
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("the accelerator caught fire")
        return self.inner.step()


@pytest.fixture
def gated(model_dir):
    source = load(model_dir)
    engine = GatedEngine(Engine(source.model, source.tokenizer, EngineConfig(cache_memory_mb=4, max_batch_size=1)))
    app = create_app(engine, model_name=MODEL_NAME, chat_template=source.chat_template, max_batch_size=1, max_queue=1)
    with BackgroundServer(app) as srv:
        yield srv, engine, app.state.server
    engine.gate.set()


def stats(server) -> dict:
    return json.loads(urllib.request.urlopen(server.base_url + "/stats").read())


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_overload_is_a_429_and_the_queued_requests_still_finish(gated):
    server, engine, _ = gated
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    results = []

    def one():
        results.append(client.completions.create(model=MODEL_NAME, prompt="To be", max_tokens=4, temperature=0))

    threads = [threading.Thread(target=one) for _ in range(2)]  # max batch 1 + max queue 1: the server is full
    for t in threads:
        t.start()
    wait_for(lambda: stats(server)["in_flight"] == 2)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=MODEL_NAME, prompt="To be", max_tokens=4)
    assert err.value.status_code == 429 and "capacity" in err.value.message
    assert stats(server)["rejected"] == 1
    engine.gate.set()
    for t in threads:
        t.join(60)
    assert [r.choices[0].finish_reason for r in results] == ["length", "length"]
    assert stats(server)["in_flight"] == 0


def test_engine_failure_is_a_503_now_and_after(gated):
    server, engine, _ = gated
    engine.fail = True
    engine.gate.set()
    status, out = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "To be", "max_tokens": 4})
    assert status == 503 and "accelerator caught fire" in out["error"]["message"]
    status, out = post(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT})
    assert status == 503 and out["error"]["message"].startswith("the engine failed")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.base_url + "/health")
    assert err.value.code == 503


def test_shutting_down_is_a_503(gated):
    server, engine, state = gated
    engine.gate.set()
    state.loop.stop()
    status, out = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "To be"})
    assert status == 503 and "shutting down" in out["error"]["message"]


def test_a_client_leaving_a_stream_frees_its_slot(gated):
    server, engine, _ = gated
    engine.delay = 0.02  # 500 tokens would take 10 s: the abort, not the end, frees the slot
    engine.gate.set()
    body = {"model": MODEL_NAME, "prompt": "To be", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        first = next(response.iter_lines())
        assert first.startswith("data: {")
    wait_for(lambda: stats(server)["in_flight"] == 0, timeout=5)
    assert stats(server)["finished"] == 0  # aborted, not run to the end


def test_a_client_leaving_before_its_whole_response_frees_its_slot(gated):
    server, engine, _ = gated
    engine.delay = 0.02
    engine.gate.set()
    body = {"model": MODEL_NAME, "prompt": "To be", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.0)
    wait_for(lambda: stats(server)["in_flight"] == 0, timeout=5)  # polled every 0.5 s: well before 500 tokens
    assert stats(server)["finished"] == 0
