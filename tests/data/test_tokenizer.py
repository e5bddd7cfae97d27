"""Tokenizer: exact round trips, deterministic training, special tokens of foreign tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import models, pre_tokenizers, trainers

from lockstep.data import Tokenizer
from lockstep.data.tokenizer import ENDOFTEXT, train_bpe


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_arbitrary_unicode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=20), max_size=4))
def test_round_trip_with_special_token_in_text(tokenizer: Tokenizer, parts: list[str]) -> None:
    text = ENDOFTEXT.join(parts)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_real_tokenizer_basics(tokenizer: Tokenizer, works: dict[str, str]) -> None:
    assert tokenizer.vocab_size == 4096
    assert tokenizer.eos_id == tokenizer.bos_id == 0
    text = works["sonnets"][:2000]
    ids = tokenizer.encode(text)
    assert len(ids) < len(text) / 2.5  # BPE trained on the corpus compresses it
    assert tokenizer.encode(text, add_bos=True) == [tokenizer.bos_id, *ids]
    assert tokenizer.decode(tokenizer.encode(text, add_bos=True), skip_special_tokens=True) == text
    assert tokenizer.encode_batch(["to be", "or not"]) == [tokenizer.encode("to be"),
                                                            tokenizer.encode("or not")]


def test_training_is_deterministic(tmp_path: Path, works: dict[str, str]) -> None:
    texts = [works[name] for name in ("hamlet", "sonnets", "tempest")]
    first = train_bpe(texts, 600, tmp_path / "a.json")
    second = train_bpe(iter(texts), 600, tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert first.vocab_size == second.vocab_size == 600
    assert first.eos_id == 0 and first.bos_id == 0
    assert train_bpe(texts, 700, tmp_path / "c.json").vocab_size == 700


def test_save_and_reload(tmp_path: Path, tokenizer: Tokenizer) -> None:
    tokenizer.save(tmp_path / "tokenizer.json")
    again = Tokenizer.from_file(tmp_path / "tokenizer.json")
    sample = "Shall I compare thee to a summer's day?"
    assert again.encode(sample) == tokenizer.encode(sample)
    assert (again.vocab_size, again.eos_id, again.bos_id) == (4096, 0, 0)


def _foreign_tokenizer(path: Path, specials: list[str]) -> Path:
    """A small HF tokenizer.json with the given special tokens (like a Llama/Qwen one)."""
    inner = tokenizers.Tokenizer(models.BPE(unk_token=None))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    inner.train_from_iterator(["hello world"] * 10, trainer=trainer)
    inner.save(str(path))
    return path


def test_detects_llama_style_specials(tmp_path: Path) -> None:
    path = _foreign_tokenizer(tmp_path / "tokenizer.json", ["<unk>", "<s>", "</s>"])
    tok = Tokenizer.from_file(path)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.encode("hello", add_bos=True)[0] == 1


def test_detects_chatml_specials_and_config(tmp_path: Path) -> None:
    path = _foreign_tokenizer(tmp_path / "tokenizer.json", ["<|im_start|>", "<|im_end|>"])
    tok = Tokenizer.from_file(path)
    assert tok.eos_token == "<|im_end|>" and tok.bos_id is None
    with pytest.raises(ValueError, match="begin-of-sequence"):
        tok.encode("hello", add_bos=True)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|im_start|>"}, "bos_token": "<|im_start|>"}))
    tok = Tokenizer.from_file(path)
    assert tok.eos_token == tok.bos_token == "<|im_start|>"
    assert Tokenizer.from_file(path, eos_token="<|im_end|>").eos_token == "<|im_end|>"


def test_errors(tmp_path: Path) -> None:
    path = _foreign_tokenizer(tmp_path / "tokenizer.json", ["<pad>"])
    with pytest.raises(ValueError, match="end-of-sequence.*<pad>"):
        Tokenizer.from_file(path)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_file(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="vocab_size must be >= 257"):
        train_bpe(["abc"], 100, tmp_path / "tiny.json")
