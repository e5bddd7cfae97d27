"""The sparse indexer's own training signal and its limits: the KL loss against the main attention
(what it is, that it trains only the indexer, that it falls), the dense warm-up stage, and the clear
refusals (batch-invariant mode, tensor and context parallelism, bad configs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lockstep import numerics
from lockstep.config.base import ConfigError
from lockstep.models.common.mla import MLAConfig
from lockstep.models.common.sparse_indexer import SparseIndexerConfig
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config


def _model(seed: int = 0, **indexer):
    cfg = dataclasses.replace(model_config("deepseek_v32", "debug"), vocab_size=128)
    att = cfg.attention
    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(att, indexer=dataclasses.replace(att.indexer,
                                                                                                  **indexer)))
    model = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that attention patterns are far from uniform
        for name, p in model.named_parameters():
            p.copy_((1.0 if p.ndim == 1 and not name.endswith("bias") else 0.0)
                    + 0.15 * torch.randn(p.shape, generator=gen))
    return model


def _tokens(seq: int = 21, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seed))


def test_kl_loss_is_the_kl_to_the_head_summed_attention():
    """record_loss == sum_t KL(p_t || softmax(I_t)) / rows, with p the main attention's probabilities
    summed over heads and L1-normalised (computed here from the definition), over the seen keys."""
    model = _model(loss_weight=0.5).train()
    indexer = model.layers["0"].attention.indexer
    gen = torch.Generator().manual_seed(3)
    b, h, t, d = 2, 4, 9, 6
    q, k = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    scores = torch.randn(b, t, t, generator=gen, requires_grad=True)
    seen = torch.rand(b, 1, t, t, generator=gen) < 0.6
    seen |= torch.eye(t, dtype=torch.bool)  # every query sees at least itself
    indexer.record_loss(scores, q, k, 0.3, seen)
    losses, metrics = indexer.pop_auxiliary()
    total = 0.0
    for bi in range(b):
        for ti in range(t):
            keys = seen[bi, 0, ti].nonzero()[:, 0]
            logits = 0.3 * (q[bi, :, ti, None, :] @ k[bi, :, keys].transpose(-1, -2))[:, 0]  # [H, keys]
            p = torch.softmax(logits, dim=-1).sum(0)
            p = p / p.sum()
            total += F.kl_div(torch.log_softmax(scores[bi, ti, keys], -1), p, reduction="sum")
    torch.testing.assert_close(losses["kl"], 0.5 * total / (b * t), rtol=1e-5, atol=1e-6)
    assert float(metrics["kl"]) > 0.1
    assert indexer.pop_auxiliary() == ({}, {})  # popped


def test_kl_loss_trains_only_the_indexer_and_lm_loss_only_the_rest():
    model = _model(loss_weight=1.0).train()
    tokens, targets = _tokens(), _tokens(seed=2)
    lm = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    losses, _ = model.pop_auxiliary()
    kl = {k: v for k, v in losses.items() if k.endswith("indexer/kl")}
    assert sorted(kl) == [f"layers.{i}.attention.indexer/kl" for i in range(3)] + ["mtp.0.block.attention.indexer/kl"]
    params = dict(model.named_parameters())
    indexer = [n for n in params if ".indexer." in n]
    rest = [n for n in params if ".indexer." not in n]
    kl_grads = torch.autograd.grad(sum(kl.values()), [params[n] for n in params], allow_unused=True)
    by_name = dict(zip(params, kl_grads))
    assert all(by_name[n] is not None and by_name[n].abs().sum() > 0 for n in indexer)
    assert all(by_name[n] is None for n in rest)
    lm_grads = dict(zip(params, torch.autograd.grad(lm, [params[n] for n in params], allow_unused=True)))
    assert all(lm_grads[n] is None for n in indexer)
    assert sum(lm_grads[n] is not None for n in rest) > len(rest) // 2


def test_no_loss_recorded_when_off_or_in_eval():
    for model in (_model(loss_weight=0.0).train(), _model(loss_weight=1.0).eval()):
        model(_tokens())
        losses, _ = model.pop_auxiliary()
        assert not any("indexer" in k for k in losses)


def test_dense_warmup_stage_trains_the_indexer_against_dense_attention():
    """stage="dense": the logits are those of dense attention (top-k past the sequence), and a few
    Adam steps on the indexer alone lower its KL loss."""
    warm = _model(loss_weight=1.0, stage="dense").train()
    dense = _model(topk=512).train()
    tokens = _tokens()
    with torch.no_grad():
        # fp32 dense attention, SDPA is_causal against an explicit causal mask: ~1e-6
        torch.testing.assert_close(warm(tokens), dense(tokens), rtol=0, atol=1e-5)
        assert (warm(tokens) - _model(loss_weight=1.0).train()(tokens)).abs().max() > 1e-3
    warm.pop_auxiliary()
    opt = torch.optim.Adam([p for n, p in warm.named_parameters() if ".indexer." in n], lr=3e-2)
    history = []
    for _ in range(8):
        warm(tokens)
        kl = sum(v for k, v in warm.pop_auxiliary()[0].items() if k.endswith("indexer/kl"))
        opt.zero_grad()
        kl.backward()
        opt.step()
        history.append(float(kl.detach()))
    assert history[-1] < 0.7 * history[0], history


def test_batch_invariant_mode_refuses_naming_the_op():
    model = _model().eval()
    with numerics.batch_invariant(), pytest.raises(NotImplementedError, match="sparse_indexer.topk_mask"):
        model(_tokens())


def test_tensor_and_context_parallel_refused():
    from lockstep.ops.attention import set_attention_wrapper
    from lockstep.parallel.tp_blocks import check_tp_divides

    model = _model().eval()
    with pytest.raises(ConfigError, match=r"parallel.tp: .*layers.0.attention.indexer"):
        check_tp_divides(model, 2)
    set_attention_wrapper(model, lambda inner, q, k, v, **kw: inner(q, k, v, **kw))
    with pytest.raises(NotImplementedError, match="context parallelism"):
        model(_tokens())


def test_config_errors_name_the_field():
    indexer = SparseIndexerConfig(n_heads=2, head_dim=8, topk=4)
    with pytest.raises(ConfigError, match=r"^attention.q_lora_rank"):
        MLAConfig(q_lora_rank=0, qk_rope_head_dim=4, indexer=indexer).validate("attention")
    with pytest.raises(ConfigError, match=r"^attention.indexer.head_dim"):
        MLAConfig(q_lora_rank=8, qk_rope_head_dim=16, indexer=indexer).validate("attention")
    with pytest.raises(ConfigError, match=r"^attention.indexer.stage"):
        MLAConfig(q_lora_rank=8, qk_rope_head_dim=4, indexer=dataclasses.replace(indexer, stage="warm")
                  ).validate("attention")
    with pytest.raises(ConfigError, match=r"^attention.indexer.loss_weight"):
        MLAConfig(q_lora_rank=8, qk_rope_head_dim=4, indexer=dataclasses.replace(indexer, loss_weight=-1.0)
                  ).validate("attention")


def test_config_round_trips_through_the_checkpoint_dict():
    from lockstep.models.hf.config_io import config_from_dict, config_to_dict

    cfg = model_config("deepseek_v32", "tiny")
    back = config_from_dict(config_to_dict(cfg))
    assert back == cfg and back.attention.indexer == cfg.attention.indexer


@pytest.mark.parametrize("flavor", ["debug", "tiny"])
def test_param_count_matches_the_built_model(flavor):
    from lockstep.models.common.transformer import build_meta_model
    from lockstep.models.deepseek_v32 import param_count

    cfg = model_config("deepseek_v32", flavor)
    counts = param_count(cfg)
    assert counts["total"] == sum(p.numel() for p in build_meta_model(cfg).parameters())
    assert counts["indexer_per_layer"] > 0


def test_671b_flavor_sizes():
    """DeepSeek-V3.2-Exp: DeepSeek-V3's 671B main model plus 61 indexers (64 heads x 128, top-2048)."""
    from lockstep.models.deepseek_v32 import param_count

    cfg = model_config("deepseek_v32", "671B")
    cfg.validate()
    counts = param_count(cfg)
    assert counts["indexer_per_layer"] == 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert round((counts["total"] - counts["mtp"]) / 1e9, 1) == 671.9  # 671.0B of DeepSeek-V3 + 0.86B


def test_activation_checkpoint_recompute_records_nothing():
    """A non-reentrant checkpoint re-runs the forward inside backward: the KL loss is recomputed (same
    ops for the saved tensors) but recorded only once, and the gradients equal the plain run's."""
    from torch.utils.checkpoint import checkpoint

    model = _model(loss_weight=1.0).train()
    attn = model.layers["1"].attention
    x = torch.randn(2, 13, model.config.dim, generator=torch.Generator().manual_seed(4))
    rope = model.rope.prefix(13)
    grads = []
    for wrap in (lambda: attn(x, rope), lambda: checkpoint(attn, x, rope, use_reentrant=False)):
        attn.zero_grad()
        out = wrap()
        losses, _ = attn.indexer.pop_auxiliary()
        (out.square().mean() + losses["kl"]).backward()
        assert attn.indexer.pop_auxiliary() == ({}, {})
        grads.append({n: p.grad.clone() for n, p in attn.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and any(".wq_b" in n for n in grads[0] if n.startswith("indexer"))
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_indexer_training_knobs_do_not_change_the_architecture():
    """A checkpoint (the released one: no KL loss; or a dense warm-up run) continues with other indexer
    training knobs; a different top-k is another model."""
    from lockstep.models.hf.config_io import check_same_architecture

    base = model_config("deepseek_v32", "debug")

    def with_indexer(**changes):
        att = base.attention
        return dataclasses.replace(base, attention=dataclasses.replace(
            att, indexer=dataclasses.replace(att.indexer, **changes)))

    check_same_architecture(with_indexer(stage="dense"), with_indexer(loss_weight=1.0), "checkpoint")
    with pytest.raises(ConfigError, match=r"model.attention.indexer.topk"):
        check_same_architecture(base, with_indexer(topk=16), "checkpoint")


def test_cli_transforms_set_the_indexer_knobs():
    from lockstep.recipes.registry import get_recipe
    from lockstep.recipes.transforms import apply_transform

    cfg = get_recipe("debug-deepseek-v32").config()
    assert cfg.model.attention.indexer.loss_weight == 1.0
    off = apply_transform(cfg, "indexer_loss=0")
    assert off.model.attention.indexer.loss_weight == 0.0 and off.transforms == ["indexer_loss=0"]
    warm = apply_transform(off, "indexer_warmup")
    assert (warm.model.attention.indexer.stage, warm.model.attention.indexer.loss_weight) == ("dense", 1.0)
    with pytest.raises(ConfigError, match="indexer_loss=W"):
        apply_transform(cfg, "indexer_loss=-2")
    with pytest.raises(ConfigError, match="model.attention has no sparse indexer"):
        apply_transform(get_recipe("debug-deepseek").config(), "indexer_warmup")


def test_batch_invariant_run_configs_refuse_the_indexer():
    """Trainer and RL configs refuse batch-invariant mode with an indexer at validation, naming the field."""
    from lockstep.recipes.registry import get_recipe
    from lockstep.rl.config import RLConfig

    cfg = get_recipe("debug-deepseek-v32").config()
    cfg.validate()
    on = dataclasses.replace(cfg, numerics=dataclasses.replace(cfg.numerics, batch_invariant=True))
    with pytest.raises(ConfigError, match=r"^numerics.batch_invariant: .*layers.0.attention.indexer.*topk_mask"):
        on.validate()
    rl = RLConfig(model=cfg.model, numerics=on.numerics)
    with pytest.raises(ConfigError, match=r"^numerics.batch_invariant: .*sparse indexer"):
        rl.validate()
