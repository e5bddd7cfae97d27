"""Text <-> token ids: a thin wrapper over a Hugging Face ``tokenizers.Tokenizer``.

``train_bpe`` trains a deterministic byte-level BPE (any text round-trips exactly) with
``<|endoftext|>`` as its only special token, used as both end- and begin-of-sequence.
``Tokenizer.from_file`` loads that file or any other HF ``tokenizer.json`` and works out the
bos/eos ids from its special tokens (or a ``tokenizer_config.json`` beside it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from lockstep.data.cache import atomic_write_bytes

ENDOFTEXT = "<|endoftext|>"
#: Special tokens taken as end-of-sequence / begin-of-sequence, in order of preference.
EOS_CANDIDATES = (ENDOFTEXT, "</s>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>", "<eos>",
                  "<|end|>", "[SEP]")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")


class Tokenizer:
    """Encode text to token ids and back; knows its vocabulary size and eos/bos ids."""

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        eos_token: str | None = None,
        bos_token: str | None = None,
    ) -> None:
        self.inner = inner
        specials = [t.content for t in inner.get_added_tokens_decoder().values() if t.special]
        eos = eos_token or _first_present(EOS_CANDIDATES, specials)
        if eos is None:
            raise ValueError(
                f"cannot tell the end-of-sequence token: none of {list(EOS_CANDIDATES)} is a "
                f"special token of this tokenizer (its special tokens are {specials}); "
                f"pass eos_token=..."
            )
        bos = bos_token or _first_present(BOS_CANDIDATES, specials)
        if bos is None and eos == ENDOFTEXT:
            bos = ENDOFTEXT  # GPT-2 convention: <|endoftext|> separates and starts documents
        self.eos_token, self.bos_token = eos, bos
        self.eos_id: int = self._token_id(eos)
        self.bos_id: int | None = None if bos is None else self._token_id(bos)

    def _token_id(self, token: str) -> int:
        token_id = self.inner.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @classmethod
    def from_file(
        cls, path: str | Path, eos_token: str | None = None, bos_token: str | None = None
    ) -> "Tokenizer":
        """Load a ``tokenizer.json``. bos/eos come from the arguments, else from a
        ``tokenizer_config.json`` in the same folder, else from the special tokens."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        inner = tokenizers.Tokenizer.from_file(str(path))
        config_eos, config_bos = _tokens_from_hf_config(path.parent / "tokenizer_config.json")
        return cls(inner, eos_token or config_eos, bos_token or config_bos)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, including added/special tokens."""
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text`` (no special tokens added unless ``add_bos``)."""
        ids = self.inner.encode(text, add_special_tokens=False).ids
        return [self._require_bos(), *ids] if add_bos else ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        """``encode`` for many texts at once (uses the tokenizers thread pool)."""
        encodings = self.inner.encode_batch(list(texts), add_special_tokens=False)
        prefix = [self._require_bos()] if add_bos else []
        return [prefix + e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids; with the default, ``decode(encode(x)) == x``."""
        return self.inner.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as ``tokenizer.json`` (atomically)."""
        atomic_write_bytes(Path(path), self.inner.to_str(pretty=True).encode("utf-8"))

    def _require_bos(self) -> int:
        if self.bos_id is None:
            raise ValueError("this tokenizer has no begin-of-sequence token; use add_bos=False")
        return self.bos_id

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}, "
                f"bos={self.bos_token!r})")


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | Path) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts``, save it to ``path`` and return it.

    Deterministic: the same texts (in the same order) and vocab size give a byte-identical
    ``tokenizer.json``. The 256 byte symbols are always in the vocabulary, so any text encodes.
    """
    minimum = 256 + 1
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum} (256 bytes + {ENDOFTEXT}), "
                         f"got {vocab_size}")
    inner = tokenizers.Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(texts, trainer=trainer)
    tokenizer = Tokenizer(inner)
    tokenizer.save(path)
    return tokenizer


def _first_present(candidates: Sequence[str], specials: Sequence[str]) -> str | None:
    return next((c for c in candidates if c in specials), None)


def _tokens_from_hf_config(path: Path) -> tuple[str | None, str | None]:
    """(eos, bos) named by a transformers ``tokenizer_config.json``, when there is one."""
    if not path.is_file():
        return None, None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None

    def content(value: object) -> str | None:
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) and value else None

    return content(config.get("eos_token")), content(config.get("bos_token"))
