"""GGUF conversion pieces that need no download: the q/k un-permutation and the recipe config."""

from __future__ import annotations

import numpy as np
import pytest

from lockstep.models.hf.gguf import reverse_permute
from lockstep.recipes.smollm2 import smollm2_config, smollm2_shakespeare


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF half-rotation -> interleaved pairs)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@pytest.mark.parametrize("n_heads, head_dim", [(9, 64), (3, 64), (4, 8)])
def test_reverse_permute_undoes_llama_cpp(n_heads, head_dim):
    w = np.random.default_rng(0).standard_normal((n_heads * head_dim, 12)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_heads)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(reverse_permute(permuted, n_heads), w)


def test_smollm2_recipe_config_validates():
    cfg = smollm2_shakespeare()
    cfg.validate()
    assert cfg.model == smollm2_config(max_seq_len=2048)
    assert cfg.data.tokenizer_path.endswith("SmolLM2-135M-Instruct/tokenizer.json")
