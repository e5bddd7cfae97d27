"""DataConfig: validation messages, cache resolution, cached builds, concurrent preparation."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.data import DataBundle, DataConfig, Tokenizer, prepare
from lockstep.data.tokenizer import train_bpe

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"vocab_size": 0}, "data.vocab_size: must be > 0"),
        ({"vocab_size": 100}, "data.vocab_size: must be >= 257"),
        ({"dataset": "tinystories"}, "data.dataset: must be one of ['shakespeare']"),
        ({"val_fraction": 1.5}, "data.val_fraction: must be in (0, 1)"),
        ({"val_fraction": 0.0}, "data.val_fraction"),
        ({"split_seed": 1.5}, "data.split_seed"),
    ],
)
def test_validation_names_the_field(changes: dict[str, Any], field: str) -> None:
    config = DataConfig().replace(**changes)
    with pytest.raises(ConfigError) as info:
        config.validate("data")
    assert str(info.value).startswith(field)


def test_tokenizer_path_must_be_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^tokenizer_path: .*not a file"):
        DataConfig(tokenizer_path=str(tmp_path)).validate()


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LOCKSTEP_CACHE", raising=False)
    assert DataConfig().resolved_cache_dir() == Path.home() / ".cache" / "lockstep"
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path / "env"))
    assert DataConfig().resolved_cache_dir() == tmp_path / "env"
    config = DataConfig(cache_dir=str(tmp_path / "field"))
    assert config.resolved_cache_dir() == tmp_path / "field"
    assert config.resolved_tokenizer_path() == tmp_path / "field/shakespeare/tokenizer-4096.json"


def test_prepare_reports_the_real_corpus(prepared: dict[str, Any]) -> None:
    assert prepared["train_works"] + prepared["val_works"] == 42
    assert prepared["val_works"] == 4
    assert set(prepared["train_work_names"]).isdisjoint(prepared["val_work_names"])
    assert prepared["vocab_size"] == 4096
    assert prepared["train_tokens"] > 1_000_000 and prepared["val_tokens"] > 50_000
    for key in ("tokenizer_path", "train_tokens_path", "val_tokens_path", "corpus_path"):
        assert Path(prepared[key]).is_file(), key


def test_cached_build(prepared: dict[str, Any], works: dict[str, str]) -> None:
    start = time.perf_counter()
    bundle = DataConfig().build(seq_len=64, batch_size=4, seed=0)
    assert time.perf_counter() - start < 1.0
    assert isinstance(bundle, DataBundle)
    assert (bundle.train_tokens, bundle.val_tokens) == (prepared["train_tokens"],
                                                        prepared["val_tokens"])
    assert bundle.val_works == prepared["val_work_names"]
    x, y = next(bundle.train)
    assert x.shape == y.shape == (4, 64) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < bundle.tokenizer.vocab_size
    # The validation stream is the validation works, in name order, each ending in eos.
    val_tokens = bundle.val.tokens
    eos = bundle.tokenizer.eos_id
    assert int((val_tokens == eos).sum()) == len(bundle.val_works) and int(val_tokens[-1]) == eos
    first = bundle.val_works[0]
    head = bundle.tokenizer.decode(val_tokens[: len(bundle.tokenizer.encode(works[first]))])
    assert head == works[first]
    assert next(bundle.val.iter_epoch())[0].shape == (4, 64)


def test_existing_hf_tokenizer_is_loaded_not_trained(
    seeded_cache: Path, works: dict[str, str]
) -> None:
    path = seeded_cache / "elsewhere" / "tokenizer.json"
    train_bpe([works["sonnets"]], 300, path)
    before = path.read_bytes()
    config = DataConfig(cache_dir=str(seeded_cache), tokenizer_path=str(path), vocab_size=9999)
    info = prepare(config, verbose=False)
    assert info["vocab_size"] == 300 and path.read_bytes() == before
    assert not list((seeded_cache / "shakespeare").glob("tokenizer-*.json"))
    assert prepare(config, verbose=False)["cached"]


def test_concurrent_prepare_in_fresh_cache(seeded_cache: Path) -> None:
    code = ("import sys; from lockstep.data import DataConfig, prepare; "
            "i = prepare(DataConfig(cache_dir=sys.argv[1], vocab_size=512), verbose=False); "
            "print(i['tokenizer_sha256'], i['train_tokens'], i['val_tokens'])")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(seeded_cache)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=400) for p in procs]  # 120 s ran out once on a host at load ~30
    assert all(p.returncode == 0 for p in procs), outputs
    assert outputs[0][0] == outputs[1][0] and outputs[0][0].strip()
    leftovers = [p.name for p in (seeded_cache / "shakespeare").rglob("*.tmp")]
    assert leftovers == []
    info = prepare(DataConfig(cache_dir=str(seeded_cache), vocab_size=512), verbose=False)
    assert info["cached"] and info["tokenizer_sha256"] == outputs[0][0].split()[0]
    assert Tokenizer.from_file(info["tokenizer_path"]).vocab_size == 512


def test_cli_prints_summary(prepared: dict[str, Any]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lockstep.data.prepare", "--cache-dir", prepared["cache_dir"]],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "cached" in lines[0] and "38 train / 4 val works" in lines[0]
