"""Tiny random transformers models, saved with ``save_pretrained``, for the HF interop tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import transformers

#: sizes of every tiny model; tests override what they exercise
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough that attention and norms matter (HF's init makes logits ~0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm scales
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def hf_model(kind: str, attn: str = "eager", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random LlamaForCausalLM (kind="llama") or Qwen3ForCausalLM (kind="qwen3"), fp32, eval."""
    fields = {**BASE, **overrides}
    if kind == "llama":
        config = transformers.LlamaConfig(**fields)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
        config = transformers.Qwen3Config(**fields)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    randomize_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


@pytest.fixture
def make_hf_dir(tmp_path: Path) -> Callable[..., tuple[torch.nn.Module, Path]]:
    """make_hf_dir(kind, name=..., **config) -> (transformers model, directory it was saved to)."""
    counter = iter(range(1000))

    def make(kind: str = "llama", name: str | None = None, max_shard_size: str | None = None,
             **overrides: Any) -> tuple[torch.nn.Module, Path]:
        model = hf_model(kind, **overrides)
        path = tmp_path / (name or f"{kind}-{next(counter)}")
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, **kwargs)
        return model, path

    return make


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def build_hf() -> Callable[..., torch.nn.Module]:
    """build_hf(kind, **config) -> a random transformers model (not saved)."""
    return hf_model


@pytest.fixture
def randomize() -> Callable[..., None]:
    return randomize_
