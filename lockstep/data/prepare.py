"""Command line: ``python -m lockstep.data.prepare`` fetches and caches the training data.

Downloads the corpus, trains the tokenizer if missing and caches the tokenized splits (all
idempotent), then prints a one-line summary. Used by ``make run``/``make test`` set-up.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lockstep.data.config import DataConfig, prepare


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run :func:`lockstep.data.prepare`, return the exit code."""
    defaults = DataConfig()
    parser = argparse.ArgumentParser(prog="python -m lockstep.data.prepare", description=__doc__)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size,
                        help=f"BPE vocabulary size (default {defaults.vocab_size})")
    parser.add_argument("--cache-dir", default=defaults.cache_dir,
                        help="cache folder (default $LOCKSTEP_CACHE, else ~/.cache/lockstep)")
    args = parser.parse_args(argv)
    prepare(DataConfig(vocab_size=args.vocab_size, cache_dir=args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
