"""Keep observe tests off the real per-user cache and free of a CI-wide peak override."""

import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LOCKSTEP_PEAK_FLOPS", raising=False)
