"""Peak memory of prefilling one long prompt: one-shot vs chunked (``EngineConfig.prefill_chunk``).

Each setting runs in a fresh child process: build the model and the engine (the KV cache is allocated
up front), record the peak RSS, prefill one ``--prompt-len``-token prompt (greedy, 1 new token), and
report the peak RSS growth during the prefill (``ru_maxrss``: the activations and the context copies,
the cache itself being already resident) and the time.

    .venv/bin/python benchmarks/prefill_memory.py [--family llama3] [--flavor debug] [--prompt-len 4000]
        [--chunks 0,256,1024]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, time, dataclasses, torch
from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
family, flavor, n, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
base = model_config(family, flavor)
cfg = dataclasses.replace(base, max_seq_len=max(n + 8, base.max_seq_len))
model = build_model(cfg, seed=0).eval()
engine = Engine(model, None, EngineConfig(cache_memory_mb=256, max_batch_size=1, max_prefill_tokens=n,
                                          prefill_chunk=chunk))
prompt = torch.randint(1, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
[result] = engine.generate([Request(prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=1, temperature=0.0))])
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_growth_mib": (after - before) / 1024, "seconds": seconds, "token": result.token_ids[0]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama3")
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--prompt-len", type=int, default=4000)
    parser.add_argument("--chunks", default="0,256,1024")
    args = parser.parse_args()
    print(f"{args.family} {args.flavor}, one prompt of {args.prompt_len} tokens, fp32")
    print(f"{'prefill_chunk':>13} {'peak RSS growth MiB':>20} {'seconds':>8} {'first token':>11}")
    for chunk in [int(c) for c in args.chunks.split(",")]:
        out = subprocess.run([sys.executable, "-c", CHILD, args.family, args.flavor, str(args.prompt_len), str(chunk)],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{chunk or 'off':>13} {r['peak_growth_mib']:>20.1f} {r['seconds']:>8.2f} {r['token']:>11}", flush=True)


if __name__ == "__main__":
    main()
