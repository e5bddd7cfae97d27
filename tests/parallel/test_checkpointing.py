"""Activation checkpointing: less memory kept for backward, bitwise identical gradients."""

import pytest
import torch
import torch.nn.functional as F

from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.checkpointing import (ActivationCheckpointConfig, activation_bytes_after_forward,
                                             apply_activation_checkpointing)


def _grads_and_memory(mode):
    cfg = model_config("llama3", "debug")
    model = apply_activation_checkpointing(build_model(cfg, seed=0), ActivationCheckpointConfig(mode=mode))
    tokens = torch.randint(0, cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    holder = {}

    def forward():
        holder["loss"] = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    saved = activation_bytes_after_forward(forward)
    holder["loss"].backward()
    names = [n.replace("._checkpoint_wrapped_module", "") for n, _ in model.named_parameters()]
    return saved, dict(zip(names, (p.grad for p in model.parameters())))


def test_modes_save_memory_and_keep_gradients_bitwise():
    results = {mode: _grads_and_memory(mode) for mode in ("none", "full", "selective")}
    none, full, selective = (results[m][0] for m in ("none", "full", "selective"))
    assert full < selective < none, (none, selective, full)
    for mode in ("full", "selective"):
        for name, grad in results["none"][1].items():
            assert torch.equal(grad, results[mode][1][name]), (mode, name)


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="training.activation_checkpoint.mode"):
        apply_activation_checkpointing(build_model(model_config("llama3", "debug")), "most")


def test_a_mode_string_is_shorthand_for_the_section():
    """Function calls (tests, the pipeline runner's stage parallelizer) may pass the mode alone."""
    cfg = model_config("llama3", "debug")
    by_string = apply_activation_checkpointing(build_model(cfg, seed=0), "full")
    by_section = apply_activation_checkpointing(build_model(cfg, seed=0), ActivationCheckpointConfig(mode="full"))
    assert [type(b).__name__ for b in by_string.layers.values()] == \
        [type(b).__name__ for b in by_section.layers.values()] == ["CheckpointWrapper"] * cfg.n_layers
