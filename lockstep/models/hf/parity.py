"""A quick numerical check that a family computes what Hugging Face transformers computes.

``family_parity(family)`` builds the family's ``debug`` flavor with random weights, writes it with
``save_hf``, loads it with ``transformers.AutoModelForCausalLM.from_pretrained`` and compares fp32
logits on random tokens. The trainer runs it at start-up and records the result in the run
manifest's ``checks`` (family, transformers version, max abs diff), so a run says which reference
its model definition was checked against. transformers is a test-time dependency: without it the
check is recorded as not run, never as passed.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

#: fp32 logits of the same function differ only by summation order (~1e-6 here); see docs/numerics.md
TOLERANCE = 1e-4


def family_parity(family: str, flavor: str = "debug", seed: int = 0, seq_len: int = 24) -> dict[str, Any]:
    """Max |logits(lockstep) - logits(transformers)| for ``family``'s ``flavor``, with metadata."""
    from lockstep.models.common.transformer import build_model
    from lockstep.models.hf.io import save_hf
    from lockstep.models.registry import model_config

    started = time.perf_counter()
    record: dict[str, Any] = {"family": family, "flavor": flavor, "tolerance": TOLERANCE, "dtype": "float32"}
    try:
        import transformers
    except ImportError:
        return {**record, "passed": False, "ran": False, "reason": "transformers is not installed"}
    record["transformers"] = transformers.__version__
    cfg = model_config(family, flavor)
    if getattr(cfg, "n_mtp", 0):  # HF runs no MTP heads in forward; compare the main model
        cfg = dataclasses.replace(cfg, n_mtp=0)
    model = build_model(cfg, seed=seed).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed))
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, Path(tmp))
        try:
            hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        except ValueError:  # vision-language families (qwen3_vl): text-only logits of the image-text model
            hf = transformers.AutoModelForImageTextToText.from_pretrained(tmp, dtype=torch.float32).eval()
        with torch.no_grad():
            ours, theirs = model(tokens), hf(input_ids=tokens).logits
    diff = float((ours - theirs).abs().max())
    return {**record, "ran": True, "max_abs_diff": diff, "passed": diff <= TOLERANCE,
            "seconds": round(time.perf_counter() - started, 2)}
