"""Context parallel composed with other model pieces, in one process: what is refused by name, and
the MTP shift's indexing (multi-process parity: tests/parallel/test_loss_parity.py, cp layouts)."""

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.context import ContextParallel, shard_positions
from lockstep.parallel.context_losses import install_auxiliary, mtp_shift, remove_auxiliary


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_recurrent_layers_are_refused_by_name(family):
    model = build_model(model_config(family, "debug"), seed=0)
    with pytest.raises(ConfigError, match=r"parallel.cp: .* layers\.\d+\.attention is a GatedDeltaNet .*parallel.cp=1"):
        ContextParallel().install(model)


def test_attention_sinks_and_sliding_windows_are_refused_by_name():
    model = build_model(model_config("gpt_oss", "debug"), seed=0)
    with pytest.raises(ConfigError, match=r"parallel.cp: layers\.0\.attention has attention sinks or a sliding window"):
        ContextParallel().install(model)


def test_mtp_with_moe_balancing_is_refused_naming_the_fields():
    cfg = model_config("deepseek_v3", "debug")
    cfg.feed_forward.bias_update_speed = 0.01
    model = build_model(cfg, seed=0)
    with pytest.raises(ConfigError, match=r"parallel.cp: .*mtp.0 .*model.feed_forward.bias_update_speed=0"):
        install_auxiliary(model, ContextParallel())


def test_hooks_are_set_and_removed():
    model = build_model(model_config("deepseek_v3", "debug"), seed=0)
    cp = ContextParallel()
    install_auxiliary(model, cp)
    moes = [m for m in model.modules() if hasattr(m, "sequence_loss")]
    assert model.mtp_context is cp and moes and all(m.sequence_loss is not None for m in moes)
    remove_auxiliary(model)
    assert model.mtp_context is None and all(m.sequence_loss is None and m.reduce_counts is None for m in moes)


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_shift_takes_tokens_and_targets_by_global_position(k):
    """Depth k at global position p: token t_{p+k}, target t_{p+k+1} (-100 past the end). mtp_shift
    all-gathers the ids over the cp group; in one process that is ``tokens`` itself, indexed here by
    a cp rank's positions."""
    tokens = torch.arange(100, 116)[None].repeat(2, 1)  # token id = 100 + position
    positions = shard_positions(16, 1, 2)[None]  # rank 1 of cp=2: chunks 1 and 2 -> 4..7, 8..11
    full_shift, _, _ = mtp_shift(tokens, torch.arange(16)[None], k, None)
    shifted, targets, rope_positions = mtp_shift(tokens, positions, k, None)
    assert torch.equal(shifted, 100 + positions.expand(2, -1) + k)
    assert torch.equal(targets, 100 + positions.expand(2, -1) + k + 1)
    assert torch.equal(rope_positions, positions + k)
    _, end_targets, end_positions = mtp_shift(tokens, torch.arange(16)[None], k, None)
    assert (end_targets[:, 16 - k - 1:] == -100).all() and (end_targets[:, :16 - k - 1] >= 100).all()
    assert end_positions.max() == 15 and torch.equal(full_shift[:, :16 - k], tokens[:, k:])
