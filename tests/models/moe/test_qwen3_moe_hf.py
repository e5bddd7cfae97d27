"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM (tiny random configs, no downloads):
checkpoint import through save_pretrained + load_hf, the in-memory fused layout, export through
save_hf + from_pretrained, real-shape parameter counts, and a training step."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from lockstep.config.base import ConfigError  # noqa: E402
from lockstep.models.common.moe import MoE  # noqa: E402
from lockstep.models.common.transformer import build_model  # noqa: E402
from lockstep.models.hf import load_hf, save_hf  # noqa: E402
from lockstep.models.registry import get_model_spec, model_config, spec_for_hf_model_type  # noqa: E402

# fp32 on both sides; the models differ only in summation order (attention kernel, expert
# accumulation), ~1e-6 on these logits. Routing is discrete, so the router weights are scaled up
# (initializer_range 0.1) to keep top-k margins far above that noise.
LOGITS_ATOL = 1e-4


def hf_model(norm_topk_prob: bool, seed: int = 0, **extra) -> Qwen3MoeForCausalLM:
    fields = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg = Qwen3MoeConfig(**{**fields, **extra}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # norms are initialised to 1 by HF; perturb so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def max_diff(lockstep_model, hf, tokens) -> float:
    with torch.no_grad():
        ref = hf(tokens).logits
        out = lockstep_model(tokens)
    return (out - ref).abs().max().item()


TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_load_hf_matches_transformers_logits(tmp_path, norm_topk_prob):
    hf = hf_model(norm_topk_prob)
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path, dtype=torch.float32, allow_unverified=True).eval()
    assert model.config.family == "qwen3_moe"
    assert model.config.feed_forward.norm_topk_prob is norm_topk_prob
    assert all(isinstance(layer.feed_forward, MoE) for layer in model.layers.values())
    diff = max_diff(model, hf, TOKENS)
    print(f"qwen3_moe load_hf norm_topk_prob={norm_topk_prob}: max |logits diff| = {diff:.3g}")
    assert diff <= LOGITS_ATOL


def test_dense_layers_from_mlp_only_layers_and_sparse_step(tmp_path):
    hf = hf_model(True, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path, dtype=torch.float32, allow_unverified=True).eval()
    kinds = [isinstance(layer.feed_forward, MoE) for layer in model.layers.values()]
    assert kinds == [False, True, False, False]  # (i+1) % 2 == 0 -> 1, 3; 3 is mlp-only
    diff = max_diff(model, hf, TOKENS)
    print(f"qwen3_moe mixed dense/MoE: max |logits diff| = {diff:.3g}")
    assert diff <= LOGITS_ATOL


def test_in_memory_fused_state_dict_converts_too():
    hf = hf_model(True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()  # transformers 5 layout
    adapter = get_model_spec("qwen3_moe").hf_adapter
    cfg = adapter.config_from_hf(hf.config.to_dict())
    model = build_model(cfg)
    model.load_state_dict(adapter.state_from_hf(hf.state_dict(), cfg), strict=True)
    assert max_diff(model.eval(), hf, TOKENS) <= LOGITS_ATOL
    # And back: fused export equals transformers' own tensors exactly.
    fused = adapter.state_to_hf(model.state_dict(), cfg, fused_experts=True)
    assert set(fused) == set(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        assert torch.equal(fused[name], tensor), name


@pytest.mark.parametrize("tie", [False, True])
def test_save_hf_loads_in_transformers_with_equal_logits(tmp_path, tie):
    cfg = dataclasses.replace(model_config("qwen3_moe", "debug"), vocab_size=256, tie_embeddings=tie,
                              mlp_only_layers=[1], init_std=0.1)
    model = build_model(cfg, seed=3).eval()
    save_hf(model, tmp_path)
    files = json.loads((tmp_path / "config.json").read_text())
    assert files["num_experts"] == 8 and files["model_type"] == "qwen3_moe"
    hf = Qwen3MoeForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.num_experts == 8 and hf.config.num_experts_per_tok == 2
    assert hf.config.norm_topk_prob is True and hf.config.mlp_only_layers == [1]
    diff = max_diff(model, hf, TOKENS)
    print(f"qwen3_moe save_hf -> transformers (tied={tie}): max |logits diff| = {diff:.3g}")
    assert diff <= LOGITS_ATOL


def test_state_roundtrip_and_errors():
    adapter = spec_for_hf_model_type("qwen3_moe").hf_adapter
    cfg = dataclasses.replace(model_config("qwen3_moe", "debug"), vocab_size=256)
    model = build_model(cfg)
    state = model.state_dict()
    hf_state = adapter.state_to_hf(state, cfg)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf_state
    assert "lm_head.weight" not in hf_state  # tied
    back = adapter.state_from_hf(hf_state, cfg)
    assert set(back) == set(state)
    for name in state:
        assert torch.equal(back[name], state[name]), name
    broken = dict(hf_state)
    del broken["model.layers.0.mlp.experts.3.up_proj.weight"]
    broken["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ConfigError, match=r"missing .*experts\.3\.up_proj.*unexpected .*mlp\.extra"):
        adapter.state_from_hf(broken, cfg)
    # A learned selection bias has no HF qwen3_moe equivalent.
    with torch.no_grad():
        model.layers["0"].feed_forward.e_score_correction_bias[0] = 0.5
    with pytest.raises(ConfigError, match="e_score_correction_bias"):
        adapter.state_to_hf(model.state_dict(), cfg)
    # Router settings HF qwen3_moe cannot express are refused by name.
    sig = dataclasses.replace(cfg, feed_forward=dataclasses.replace(cfg.feed_forward, score_func="sigmoid"))
    with pytest.raises(ConfigError, match="score_func"):
        adapter.config_to_hf(sig)


def test_config_roundtrip_through_transformers():
    adapter = get_model_spec("qwen3_moe").hf_adapter
    cfg = model_config("qwen3_moe", "30B-A3B")
    hf_dict = adapter.config_to_hf(cfg)
    hf_cfg = Qwen3MoeConfig(**{k: v for k, v in hf_dict.items() if k not in ("architectures", "model_type")})
    assert hf_cfg.num_experts == 128 and hf_cfg.moe_intermediate_size == 768
    back = adapter.config_from_hf(hf_cfg.to_dict())
    assert back.slots() == cfg.slots()
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "norm_eps",
                  "max_seq_len", "tie_embeddings", "rope", "decoder_sparse_step", "mlp_only_layers"):
        assert getattr(back, field) == getattr(cfg, field), field


@pytest.mark.parametrize("flavor, total, active", [
    ("30B-A3B", 30_532_122_624, 3_353_032_704),
    ("235B-A22B", 235_093_634_560, 22_190_763_520),
])
def test_real_shapes_match_transformers_parameter_counts(flavor, total, active):
    cfg = model_config("qwen3_moe", flavor)
    adapter = get_model_spec("qwen3_moe").hf_adapter
    hf_dict = adapter.config_to_hf(cfg)
    with torch.device("meta"):
        ours = cfg.build()
        theirs = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{k: v for k, v in hf_dict.items()
                                                       if k not in ("architectures", "model_type")}))
    assert ours.num_params() == sum(p.numel() for p in theirs.parameters()) == total
    ffn = sum(sum(p.numel() for p in layer.feed_forward.parameters()) for layer in ours.layers.values())
    used = sum(layer.feed_forward.active_matmul_params() for layer in ours.layers.values())
    assert ours.num_params() - ffn + used == active  # Qwen reports 3.3B / 22B activated


def test_train_step_through_experts_has_finite_grads():
    cfg = model_config("qwen3_moe", "debug")
    cfg = dataclasses.replace(cfg, feed_forward=dataclasses.replace(
        cfg.feed_forward, seq_aux_loss_coef=1e-3, bias_update_speed=1e-3))
    model = build_model(cfg, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(3):
        logits = model(inputs)
        aux, metrics = model.pop_auxiliary()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()) + sum(aux.values())
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        ff = model.layers["0"].feed_forward
        assert ff.experts.w1.grad.abs().sum() > 0 and ff.gate.weight.grad.abs().sum() > 0
        opt.step()
        model.after_optimizer_step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert len(aux) == cfg.n_layers and "layers.0.feed_forward/load_cv" in metrics
    assert model.layers["0"].feed_forward.e_score_correction_bias.abs().max() > 0
    assert losses[-1] < losses[0]


@pytest.mark.xdist_group("trainer")
def test_trainer_writes_moe_metrics_and_aux_losses(tmp_path):
    from lockstep.recipes import get_recipe
    from lockstep.train.trainer import Trainer

    cfg = get_recipe("debug").config()
    model = model_config("qwen3_moe", "debug")
    model = dataclasses.replace(model, feed_forward=dataclasses.replace(
        model.feed_forward, seq_aux_loss_coef=1e-3, bias_update_speed=1e-3))
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / "run"), model=model, steps=4)
    cfg.output = dataclasses.replace(cfg.output, progress=False)
    cfg.validation = dataclasses.replace(cfg.validation, every=0)
    result = Trainer(cfg).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in records if "loss" in r][-1]
    for key in ("layers.1.feed_forward/load_min", "layers.1.feed_forward/load_max", "layers.1.feed_forward/load_cv",
                "layers.1.feed_forward/dropped_tokens", "aux_loss/layers.1.feed_forward/seq_aux_loss"):
        assert key in step, key
    assert step["layers.1.feed_forward/dropped_tokens"] == 0.0


def test_lockstep_directory_roundtrip_keeps_moe_config_and_bias(tmp_path):
    from lockstep.models.hf import config_from_dict, config_to_dict, load_lockstep_dir, save_lockstep_dir

    cfg = dataclasses.replace(model_config("qwen3_moe", "debug"), mlp_only_layers=[0])
    cfg = dataclasses.replace(cfg, feed_forward=dataclasses.replace(cfg.feed_forward, bias_update_speed=0.01))
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
    model = build_model(cfg, seed=2)
    with torch.no_grad():
        model.layers["1"].feed_forward.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8))
    save_lockstep_dir(model, tmp_path)
    loaded = load_lockstep_dir(tmp_path)
    assert loaded.config == cfg
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
