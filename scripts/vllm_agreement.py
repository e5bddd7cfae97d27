"""Print lockstep.vllm.agreement.measure for the generation tests' tiny fp32 model of each family, with
the batch-invariant switch off and on (docs/numerics.md, "vLLM vs the trainer").

    .venv/bin/python scripts/vllm_agreement.py [--family llama3 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.generate's models

from lockstep.vllm.agreement import measure  # noqa: E402
from tests.generate.conftest import tiny_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", default=None,
                        help="model family (repeatable; default llama3, qwen3, qwen3_moe, deepseek_v3)")
    args = parser.parse_args()
    for family in args.family or ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"]:
        for mode in (False, True):
            print(json.dumps({"family": family, "batch_invariant": mode, **measure(tiny_model(family), mode)}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
