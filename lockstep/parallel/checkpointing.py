"""Activation checkpointing policies, applied to a model's blocks from outside.

- ``none``: keep every activation;
- ``full``: keep only each block's input, recompute the whole block in backward;
- ``selective``: keep matmul and attention outputs, recompute cheap elementwise ops and norms
  (``torch.utils.checkpoint`` selective-checkpoint contexts).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MODES = ["none", "full", "selective"]

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Wrap every block in ``model.layers`` according to ``mode`` (in place; returns the model)."""
    if mode not in MODES:
        raise ValueError(f"training.activation_checkpoint: must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return model
    for name, block in list(model.layers.named_children()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(
                block, preserve_rng_state=False,
                context_fn=functools.partial(create_selective_checkpoint_contexts, _selective_policy),
            )
        model.layers.register_module(name, wrapped)
    return model


def activation_bytes_after_forward(fn) -> int:
    """Net bytes the CPU allocator still holds after ``fn()`` (a forward): what autograd keeps
    for backward plus the outputs. Measured with the profiler's allocation tracking."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return int(sum(evt.self_cpu_memory_usage for evt in prof.key_averages()))
