"""A tiny served model for the server tests: a random llama3 ``debug`` model saved as a model
directory (BPE tokenizer, chat template) once per test run, loaded as ``lockstep serve`` loads it,
behind :func:`lockstep.serve.create_app` on a free 127.0.0.1 port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lockstep.generate import Engine, EngineConfig
from lockstep.load import load_model
from lockstep.serve import BackgroundServer, create_app
from tests.test_cli_generate import make_model_dir  # the generate CLI tests' tiny model directory

MODEL_NAME = "tiny"
#: the served engine's configuration; reference engines in the tests use the same one
ENGINE = dict(cache_memory_mb=16, max_batch_size=8)


@pytest.fixture(scope="session")
def model_dir(computed_once) -> Path:
    return computed_once("serve-tiny-llama3", make_model_dir)


def load(model_dir: Path):
    source = load_model(model_dir, dtype="float32")
    source.model.eval()
    return source


def reference_engine(model_dir: Path) -> tuple[Engine, object]:
    """A second, in-process engine on a second copy of the model (same configuration as the server's)."""
    source = load(model_dir)
    return Engine(source.model, source.tokenizer, EngineConfig(**ENGINE)), source


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[BackgroundServer]:
    source = load(model_dir)
    engine = Engine(source.model, source.tokenizer, EngineConfig(**ENGINE))
    app = create_app(engine, model_name=MODEL_NAME, chat_template=source.chat_template,
                     stop_token_ids=source.stop_token_ids, max_batch_size=ENGINE["max_batch_size"], max_queue=16)
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
