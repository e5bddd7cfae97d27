"""The packed-linear ops' C++ kernels vs their Python kernels inside lockstep's Engine, in one process.

SmolLM2-135M-Instruct, ``EngineConfig(max_batch_size=16, compile_decode="inductor", weights_dtype=...)``,
``--batch`` random 40-token prompts, 21 greedy new tokens per round. Rounds alternate (order flipped
every round) between the C++ kernels (:mod:`lockstep.ops.packed_op`) and the Python kernels of
:mod:`lockstep.generate.packed`, registered over them for their round through ``torch.library`` (which
restores the C++ ones when that library is destroyed); the compiled graph is the same. Per round: the
median thread CPU time of the decode steps after 4 warm ones, and a hash of every sequence's tokens and
log-probabilities (the two kernels must give the same). Needs the C++ library (a C++ compiler).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/packed_op_engine.py --dtype bfloat16 --batch 16 [--rounds 6]
    LOCKSTEP_CPU_ISA=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 OMP_NUM_THREADS=1 .venv/bin/python ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
import warnings

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from lockstep.generate import Engine, EngineConfig, Request, SamplingParams, packed
    from lockstep.models.hf import load_hf
    from lockstep.models.hf.gguf import smollm2_hf_dir

    model = load_hf(smollm2_hf_dir(), dtype=torch.float32).eval()
    weights = "bfloat16" if args.dtype == "bfloat16" else "model"
    engine = Engine(model, None, EngineConfig(max_batch_size=16, compile_decode="inductor", weights_dtype=weights))
    if not packed._CPP_KERNELS:
        raise SystemExit("the packed-linear C++ op library did not build here: nothing to compare")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 49000, (40,), generator=gen).tolist() for _ in range(args.batch)]
    sampling = SamplingParams(max_new_tokens=21, temperature=0, ignore_eos=True)

    def one_round() -> tuple[float, str]:
        for prompt in prompts:
            engine.add_request(Request(prompt_ids=prompt, sampling=sampling))
        times, results, step = [], {}, 0
        while engine.has_unfinished:
            start = time.thread_time()
            events = engine.step()
            if step > 4:  # step 0 prefills
                times.append(time.thread_time() - start)
            step += 1
            for event in events:
                results.setdefault(event.seq_id, []).append((event.token_id, event.logprob))
        digest = hashlib.sha256(json.dumps([results[k] for k in sorted(results)]).encode()).hexdigest()[:12]
        return statistics.median(times) * 1e3, digest

    one_round()  # compiles the bucket
    warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")  # the Python kernels registered over the C++ ones
    ms: dict[str, list[float]] = {"cpp": [], "python": []}
    hashes: dict[str, set[str]] = {"cpp": set(), "python": set()}
    for r in range(args.rounds):
        for mode in ("cpp", "python") if r % 2 == 0 else ("python", "cpp"):
            lib = None
            if mode == "python":
                lib = torch.library.Library("lockstep", "IMPL")
                lib.impl("packed_linear", packed.packed_linear, "CPU")
                lib.impl("packed_linear_cat", packed.packed_linear_cat, "CPU")
            step_ms, digest = one_round()
            if lib is not None:
                lib._destroy()
            ms[mode].append(round(step_ms, 2))
            hashes[mode].add(digest)
    medians = {mode: statistics.median(values) for mode, values in ms.items()}
    print(json.dumps({"dtype": args.dtype, "batch": args.batch, "ms_per_step": ms, "median": medians,
                      "python_over_cpp": round(medians["python"] / medians["cpp"], 3),
                      "hashes": {mode: sorted(h) for mode, h in hashes.items()}}))


if __name__ == "__main__":
    main()
