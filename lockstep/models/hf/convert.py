"""``lockstep convert``: Hugging Face directory <-> lockstep model directory.

    lockstep convert --from-hf HF_DIR --out LOCKSTEP_DIR [--dtype float32|bfloat16|auto] [--allow-unverified-weights]
    lockstep convert --to-hf LOCKSTEP_OR_RUN_DIR --out HF_DIR [--dtype ...] [--max-shard-size 5GB]

A lockstep directory holds ``model.safetensors`` (lockstep names), ``lockstep_model.json`` and the
tokenizer files found beside the source. ``--to-hf`` also reads training run directories
(``manifest.json`` + ``model.safetensors``), and takes bos/eos ids from their ``tokenizer.json``.
The source is verified against its checksums (a third-party HF directory has none: pass
``--allow-unverified-weights``); what is written carries checksums, so it loads verified after.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from lockstep.config.base import ConfigError

#: tokenizer files copied along with the weights, when the source has them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9,
          "T": 10**12}


def parse_size(text: str) -> int:
    """Bytes of a size such as ``5GB``, ``500MiB`` or ``1000000``."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep convert",
        description="Convert model weights between Hugging Face and lockstep directories.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="DIR", help="Hugging Face model directory to read")
    source.add_argument("--to-hf", metavar="DIR", help="lockstep model or training run directory to read")
    parser.add_argument("--out", metavar="DIR", required=True, help="directory to write")
    parser.add_argument("--dtype", default="auto", help="weight dtype to write: auto (as stored), float32, bfloat16")
    parser.add_argument("--max-shard-size", default="5GB", help="--to-hf: largest safetensors shard (default 5GB)")
    parser.add_argument("--allow-unverified-weights", action="store_true",
                        help="also read source weights without lockstep checksums (third-party HF directories)")
    return parser


def _copy_tokenizer(src: Path, out: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():
            shutil.copyfile(src / name, out / name)
            copied.append(name)
    return copied


def _token_ids(directory: Path) -> dict[str, int]:
    """bos/eos ids of the lockstep tokenizer in ``directory`` (empty when there is none)."""
    if not (directory / "tokenizer.json").is_file():
        return {}
    from lockstep.data.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_file(directory / "tokenizer.json")
    except ValueError:
        return {}
    ids = {"eos_token_id": tok.eos_id}
    if tok.bos_id is not None:
        ids["bos_token_id"] = tok.bos_id
    return ids


def cmd_convert(argv: list[str]) -> int:
    """Entry point of ``lockstep convert ARGS``; returns the exit code (ConfigError propagates)."""
    from lockstep.models.hf.io import (
        load_hf,
        load_lockstep_dir,
        read_hf_config,
        save_hf,
        save_lockstep_dir,
    )

    args = _parser().parse_args(argv)
    out = Path(args.out)
    dtype = None if args.dtype == "auto" else args.dtype
    if args.from_hf:
        src = Path(args.from_hf)
        model = load_hf(src, dtype=dtype, allow_unverified=args.allow_unverified_weights)
        save_lockstep_dir(model, out)
        copied = _copy_tokenizer(src, out)
    else:
        src = Path(args.to_hf)
        max_shard = parse_size(args.max_shard_size)
        model = load_lockstep_dir(src, dtype=dtype, allow_unverified=args.allow_unverified_weights)
        ids = _token_ids(src)
        save_hf(model, out, max_shard_bytes=max_shard, config_extra=ids,
                generation_config=dict(ids) if ids else None)
        copied = _copy_tokenizer(src, out)
        read_hf_config(out)  # sanity: what we wrote parses
    cfg = model.config
    print(f"lockstep convert: {src} -> {out}: {cfg.family} {cfg.n_layers} layers, dim {cfg.dim}, "
          f"{model.num_params():,} parameters"
          + (f"; copied {', '.join(copied)}" if copied else ""), file=sys.stdout)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m lockstep.models.hf.convert ARGS``: cmd_convert with config errors reported."""
    try:
        return cmd_convert(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"lockstep convert: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
