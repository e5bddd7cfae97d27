"""Tiny models and helpers shared by the generation tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from lockstep.generate import Engine, EngineConfig, GenerationResult
from lockstep.models.common.transformer import Transformer, build_model
from lockstep.models.registry import model_config

FAMILIES = ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"]
#: a small vocabulary keeps the output head and sampling cheap; every other size is the family's debug flavor
VOCAB = 256


def tiny_model(family: str, seed: int = 0, **changes) -> Transformer:
    """The family's ``debug`` flavor (vocab 256), fp32, eval, weights re-drawn large enough to matter.

    As in the HF parity tests (docs/numerics.md): matrices at std 0.15, norm scales 1 +- 0.2, so
    logits are O(5) and attention patterns are far from uniform (the init std of 0.02 gives
    near-constant logits, against which any cache bug would look small).
    """
    cfg = dataclasses.replace(model_config(family, "debug"), vocab_size=VOCAB, **changes)
    model = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return model.eval()


class FakeTokenizer:
    """One character per token: id i <-> chr(ord('a') + i % 26) (ids >= 26 repeat letters); eos = 0.

    Enough for stop strings and streaming text; the engine only needs encode/decode/eos_id.
    """

    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


def engine_for(model: Transformer, tokenizer=None, **config) -> Engine:
    config.setdefault("cache_memory_mb", 2)
    config.setdefault("block_size", 4)
    return Engine(model, tokenizer, EngineConfig(**config))


def record_logits(engine: Engine) -> dict[int, list[torch.Tensor]]:
    """Install ``engine.on_logits``: seq id -> the logits each of its tokens was sampled from."""
    seen: dict[int, list[torch.Tensor]] = {}

    def hook(seq_ids: list[int], logits: torch.Tensor) -> None:
        for row, seq_id in enumerate(seq_ids):
            seen.setdefault(seq_id, []).append(logits[row].clone())

    engine.on_logits = hook
    return seen


@torch.no_grad()
def full_forward_logits(model: Transformer, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Logits [len(generated), V] from one full-sequence forward (cache=None): row i predicts generated[i]."""
    ids = torch.tensor([prompt + generated[:-1]])
    return model(ids)[0, len(prompt) - 1:]


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture
def make_model() -> Callable[..., Transformer]:
    return tiny_model


def results_by_id(results: list[GenerationResult]) -> dict[str | None, GenerationResult]:
    return {r.request_id: r for r in results}
