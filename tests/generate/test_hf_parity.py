"""Greedy generation matches transformers' ``generate(do_sample=False)`` token for token (fp32).

Each family's debug flavor with large random weights (``make_model``, see conftest) is written with
``save_hf`` and loaded back by ``transformers.AutoModelForCausalLM``: the same weights on both sides.
The lockstep Engine decodes a batch of prompts of different lengths together (padded prefill, paged
cache, batched decode); transformers decodes each prompt alone (no padding), the reference.

Greedy decoding is discrete: two correct implementations differ in fp32 summation order (~1e-6 on
these logits, docs/numerics.md) and can only disagree where the top two logits are closer than that.
Each test therefore also asserts that every step's top-1/top-2 margin in transformers' logits is
>= MIN_MARGIN, so an exact token-list comparison is meaningful (a near-tie fails as a bad test
set-up, not as an engine bug). Log-probabilities are compared with LOGPROB_ATOL.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lockstep.generate import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from lockstep.models.hf import save_hf  # noqa: E402

FAMILIES = ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"]
#: prompts of different lengths in one batch: 1 token, within a block, across blocks (block size 4 and 16)
LENGTHS = [1, 5, 11, 23]
NEW_TOKENS = 16
#: implementations agree to ~1e-6 in fp32; a greedy step with a margin 100x that cannot flip
MIN_MARGIN = 1e-4
#: cache block sizes tried: 4 (every prompt but the first spans blocks) and 16 (the default)
BLOCK_SIZES = [4, 16]
#: fp32 log-softmax of logits that agree to ~1e-6 (tolerance as for logits, docs/numerics.md)
LOGPROB_ATOL = 1e-4


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prompt: list[int], max_new_tokens: int,
              eos_token_id: int | None = None) -> tuple[list[int], list[float], float]:
    """transformers' greedy tokens for one prompt, their log-probabilities and the smallest
    top-1/top-2 logit margin over the steps."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                      eos_token_id=eos_token_id, pad_token_id=eos_token_id if eos_token_id is not None else 0,
                      output_logits=True, return_dict_in_generate=True, temperature=None, top_p=None, top_k=None)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.cat(out.logits).float()  # [steps, V], unprocessed
    top2 = logits.topk(2, dim=-1).values
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return tokens, logprobs.tolist(), float((top2[:, 0] - top2[:, 1]).min())


def hf_from_lockstep(model: torch.nn.Module, path) -> torch.nn.Module:
    save_hf(model, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # random weights: no end-of-sequence token
    return hf


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(family, make_model, tmp_path):
    changes = {"n_mtp": 0} if family == "deepseek_v3" else {}  # HF runs no MTP head when generating
    model = make_model(family, seed=1, **changes)
    hf = hf_from_lockstep(model, tmp_path / family)
    prompts = random_prompts(LENGTHS, model.config.vocab_size)
    reference = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    for want, _, margin in reference:
        assert margin >= MIN_MARGIN, f"{family}: near-tie in the reference (margin {margin:.2g}); change the seed"
        assert len(want) == NEW_TOKENS
    assert len({tuple(want) for want, _, _ in reference}) == len(prompts)  # not a degenerate model
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    for block_size in BLOCK_SIZES:
        engine = Engine(model, None, EngineConfig(cache_memory_mb=4, block_size=block_size))
        results = engine.generate([Request(prompt_ids=p, sampling=greedy) for p in prompts])
        for prompt, result, (want, want_logprobs, _) in zip(prompts, results, reference):
            where = f"{family}, block_size {block_size}, prompt of {len(prompt)} tokens"
            assert result.token_ids == want, where
            assert result.finish_reason == "length", where
            torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(want_logprobs),
                                       atol=LOGPROB_ATOL, rtol=0, msg=lambda m: f"{where}: {m}")


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    from lockstep.data.tokenizer import Tokenizer
    from lockstep.generate import load_chat_template
    from lockstep.models.hf import load_hf
    from lockstep.models.hf.gguf import smollm2_hf_dir

    path = smollm2_hf_dir()
    model = load_hf(path, dtype=torch.float32).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    return model, hf, Tokenizer.from_file(path / "tokenizer.json"), load_chat_template(path)


SMOLLM2_QUESTIONS = ["What is the capital of France?", "Name three primary colours."]


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_greedy_chat_matches_transformers(smollm2):
    model, hf, tokenizer, template = smollm2
    prompts = [template.encode(tokenizer, [{"role": "user", "content": q}]) for q in SMOLLM2_QUESTIONS]
    prompts.append(tokenizer.encode("ROMEO: But, soft! what light through yonder window breaks?"))
    new = 20
    engine = Engine(model, tokenizer, EngineConfig(cache_memory_mb=64))
    results = engine.generate([Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=new, temperature=0))
                               for p in prompts])
    for prompt, result in zip(prompts, results):
        want, want_logprobs, margin = hf_greedy(hf, prompt, new, eos_token_id=tokenizer.eos_id)
        print(f"SmolLM2: {tokenizer.decode(want)!r} (min top-2 margin {margin:.3g})")
        assert margin >= MIN_MARGIN, f"near-tie in the reference (margin {margin:.2g}); change the prompt"
        assert result.token_ids == want
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(want_logprobs),
                                   atol=LOGPROB_ATOL, rtol=0)
        assert result.finish_reason == ("stop" if want[-1] == tokenizer.eos_id else "length")
    assert "Paris" in results[0].text
