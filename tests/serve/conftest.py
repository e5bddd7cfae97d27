"""A tiny served model for the server tests: a random llama3 ``debug`` model saved as a model
directory (BPE tokenizer, chat template) once per test run, loaded as ``lockstep serve`` loads it,
behind :func:`lockstep.serve.create_app` on a free 127.0.0.1 port."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lockstep.data.tokenizer import train_bpe
from lockstep.generate import Engine, EngineConfig
from lockstep.load import load_model
from lockstep.models.common.transformer import build_model
from lockstep.models.hf import save_hf
from lockstep.models.registry import model_config
from lockstep.serve import BackgroundServer, create_app

MODEL_NAME = "tiny"
TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|endoftext|>assistant:{% endif %}")
TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings "
        "and arrows of outrageous fortune, or to take arms against a sea of troubles. ") * 20
#: the served engine's configuration; reference engines in the tests use the same one
ENGINE = dict(cache_memory_mb=16, max_batch_size=8)


def make_model_dir(path: Path) -> None:
    tok = train_bpe([TEXT], 320, path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    cfg = dataclasses.replace(model_config("llama3", "debug"), vocab_size=tok.vocab_size)
    model = build_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # as tests/generate's models: logits O(5), so greedy text varies
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if p.ndim == 1
                    else 0.15 * torch.randn(p.shape, generator=gen))
    save_hf(model, path)


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
