"""Activation checkpointing policies, applied to a model's blocks from outside.

``training.activation_checkpoint`` is a section (:class:`ActivationCheckpointConfig`) whose ``mode`` is

- ``none``: keep every activation;
- ``full``: keep only each block's input, recompute the whole block in backward;
- ``selective``: keep matmul and attention outputs, recompute cheap elementwise ops and norms
  (``torch.utils.checkpoint`` selective-checkpoint contexts);
- ``regions``: each block is a ``torch_remat`` recompute region and the submodules named by ``save``
  (module-path globs or op kinds) keep their activations (:mod:`lockstep.parallel.remat_regions`).
  An empty ``save`` list is allowed: it recomputes everything, like ``full``, through torch_remat.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lockstep.config.base import Config, ConfigError, require, require_choice

MODES = ["none", "full", "selective", "regions"]

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


@dataclasses.dataclass(kw_only=True)
class ActivationCheckpointConfig(Config):
    """What each block keeps for backward and what it recomputes."""

    #: "none", "full", "selective" (keep matmul/attention outputs) or "regions" (torch_remat: keep what `save` names)
    mode: str = "none"
    #: mode "regions": module-path globs kept, e.g. ["layers.*.attention.wo"], or op kinds "op:linear", "op:attention"
    save: list[str] = dataclasses.field(default_factory=list)

    def validate(self, path: str = "training.activation_checkpoint") -> None:
        require_choice(self.mode, MODES, f"{path}.mode")
        require(not self.save or self.mode == "regions", f"{path}.save",
                f"names save regions of mode 'regions', but mode is {self.mode!r}; set {path}.mode=regions "
                "or leave save empty")
        for entry in self.save:
            require(isinstance(entry, str) and entry != "", f"{path}.save",
                    f"entries must be non-empty globs, got {entry!r}")
        from lockstep.parallel.remat_regions import check_op_kinds

        check_op_kinds(self.save, f"{path}.save")

    def describe(self) -> str:
        """One line for reports: the mode, and the save list of mode regions."""
        if self.mode != "regions":
            return self.mode
        return f"regions (save {', '.join(self.save)})" if self.save else "regions (save nothing)"


def as_checkpoint_config(value: ActivationCheckpointConfig | str,
                         field: str = "training.activation_checkpoint") -> ActivationCheckpointConfig:
    """``value`` validated; in function calls a mode string is shorthand for a section without ``save``."""
    config = ActivationCheckpointConfig(mode=value) if isinstance(value, str) else value
    if not isinstance(config, ActivationCheckpointConfig):
        raise ConfigError(f"{field}: must be an ActivationCheckpointConfig or a mode string, got {value!r}")
    config.validate(field)
    return config


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, config: ActivationCheckpointConfig | str,
                                   *, strict: bool = True) -> nn.Module:
    """Wrap every block in ``model.layers`` according to ``config`` (in place; returns the model).

    ``strict=False`` (one pipeline stage): a save glob that matches no module of this stage is not an
    error; :func:`check_save_globs` checks the whole model before it is split."""
    config = as_checkpoint_config(config)
    if config.mode == "none":
        return model
    if config.mode == "regions":
        from lockstep.parallel.remat_regions import apply_save_regions

        return apply_save_regions(model, config.save, strict=strict)
    for name, block in list(model.layers.named_children()):
        if config.mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(
                block, preserve_rng_state=False,
                context_fn=functools.partial(create_selective_checkpoint_contexts, _selective_policy),
            )
        model.layers.register_module(name, wrapped)
    return model


def check_save_globs(model: nn.Module, config: ActivationCheckpointConfig | str) -> None:
    """Raise a ConfigError naming ``training.activation_checkpoint.save`` if a save glob or op kind
    selects nothing in ``model`` (the whole model, before a pipeline split)."""
    config = as_checkpoint_config(config)
    if config.mode == "regions":
        from lockstep.parallel.remat_regions import save_targets

        save_targets(model, config.save)


def activation_bytes_after_forward(fn) -> int:
    """Net bytes the CPU allocator still holds after ``fn()`` (a forward): what autograd keeps
    for backward plus the outputs. Measured with the profiler's allocation tracking."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return int(sum(evt.self_cpu_memory_usage for evt in prof.key_averages()))
