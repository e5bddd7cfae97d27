"""Multi-token prediction: HF MtpLayer parity, target alignment, the on/off switches, isolation and backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from deepseek_hf_reference import hf_deepseek

from lockstep.models.common.transformer import build_model
from lockstep.models.deepseek_v3 import DeepSeekV3Adapter
from lockstep.models.registry import model_config


def _debug(**changes):
    return dataclasses.replace(model_config("deepseek_v3", "debug"), vocab_size=256, **changes)


def _mtp_checkpoint(hf, mtp, n_layers):
    """The DeepSeek-V3 checkpoint layout of transformers' MtpModel weights: model.layers.{n_layers + k}.*"""
    out = {}
    for name, t in mtp.state_dict().items():
        if not name.startswith("layers."):
            continue
        _, k, rest = name.split(".", 2)
        rest = rest.replace("post_norm.", "shared_head.norm.").replace("mtp_block.", "")
        out[f"model.layers.{n_layers + int(k)}.{rest}"] = t
        out[f"model.layers.{n_layers + int(k)}.embed_tokens.weight"] = hf.model.embed_tokens.weight
        out[f"model.layers.{n_layers + int(k)}.shared_head.head.weight"] = hf.lm_head.weight
    return out


def test_mtp_layer_matches_transformers_mtp_model():
    """Depth 1 equals transformers' MtpLayer (DeepSeek's checkpoint layout) fed as its drafting does:
    tokens shifted by one, the main model's final (normed) hidden states, the shared head."""
    from transformers.modeling_layers import MtpModel

    hf, hf_cfg = hf_deepseek()
    mtp = MtpModel(hf, 1).eval()
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.startswith("layers."):
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        for name, b in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    adapter = DeepSeekV3Adapter()
    cfg = dataclasses.replace(adapter.config_from_hf(hf_cfg.to_dict()), n_mtp=1, mtp_loss_weight=0.5)
    state = adapter.state_from_hf({**hf.state_dict(), **_mtp_checkpoint(hf, mtp, hf_cfg.num_hidden_layers)}, cfg)
    model = build_model(cfg)
    model.load_state_dict(state, strict=True)
    model.train()  # MTP runs in training mode; nothing here is stochastic

    tokens = torch.randint(0, hf_cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    seq = tokens.shape[1]
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True)
        last_hidden = out.hidden_states[-1]  # the normed final hidden state, what MTP drafting reads
        ids, positions = tokens[:, 1:], torch.arange(1, seq)[None]
        embeds = mtp.embed_tokens(ids)
        mask = torch.full((seq - 1, seq - 1), float("-inf")).triu(1)[None, None]
        h = mtp.layers[0](embeds, last_hidden[:, :-1], position_embeddings=mtp.rotary_emb(embeds, positions),
                          attention_mask=mask, position_ids=positions, past_key_values=None)
        want_loss = F.cross_entropy(mtp.shared_head(h)[:, :-1].flatten(0, 1), tokens[:, 2:].flatten())

        logits = model(tokens)
        losses, metrics = model.pop_auxiliary()
    assert (logits - out.logits).abs().max().item() <= 1e-4
    assert abs(float(metrics["mtp/loss_1"]) - want_loss.item()) <= 1e-5
    assert losses["mtp/loss"].item() == pytest.approx(0.5 * float(metrics["mtp/loss_1"]), rel=1e-6)

    written = adapter.state_to_hf(model.state_dict(), cfg)  # the MTP module is written back in that layout
    assert {n for n in written if n.startswith("model.layers.3.") and ".experts." not in n} == {
        n for n in _mtp_checkpoint(hf, mtp, hf_cfg.num_hidden_layers) if ".experts." not in n}
    for name, t in adapter.state_from_hf(written, cfg).items():
        assert torch.equal(t, model.state_dict()[name]), name


def test_mtp_targets_depend_only_on_the_inputs_they_should():
    """Depth k, row i predicts tokens[i+k+1] from tokens[:i+k+1]: changing token j leaves rows i < j-k alone.

    (Unchanged rows are compared to 1e-5, not bitwise: the grouped expert matmuls see other token mixes.)"""
    model = build_model(_debug(n_mtp=2)).eval()
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(4))
    j = 10
    changed = tokens.clone()
    changed[0, j] = (changed[0, j] + 1) % 256
    with torch.no_grad():
        before, after = model.mtp_predictions(tokens), model.mtp_predictions(changed)
    assert len(before) == 2
    for k, ((lb, tb), (la, _)) in enumerate(zip(before, after), start=1):
        n = tokens.shape[1] - k - 1
        assert lb.shape[1] == n and torch.equal(tb, tokens[:, k + 1:])
        assert (lb[:, : j - k] - la[:, : j - k]).abs().max() < 1e-5, f"depth {k} saw a token it must not see"
        assert (lb[:, j - k] - la[:, j - k]).abs().max() > 1e-3, f"depth {k} row {j - k} ignores its input token"


def test_mtp_loss_present_in_training_only_and_weighted_mean_over_depths():
    model = build_model(_debug(n_mtp=2, mtp_loss_weight=0.3))
    tokens = torch.randint(0, 256, (2, 24))
    model.train()
    model(tokens)
    losses, metrics = model.pop_auxiliary()
    assert {"mtp/loss_1", "mtp/loss_2"} <= set(metrics)
    mean = (float(metrics["mtp/loss_1"]) + float(metrics["mtp/loss_2"])) / 2
    assert losses["mtp/loss"].item() == pytest.approx(0.3 * mean, rel=1e-6)
    assert model.pop_auxiliary()[0] == {}  # popping clears
    model.eval()
    model(tokens)
    assert "mtp/loss" not in model.pop_auxiliary()[0]


def test_weight_zero_and_n_mtp_zero_switch_mtp_off():
    tokens = torch.randint(0, 256, (2, 24))
    off = build_model(_debug(n_mtp=1, mtp_loss_weight=0.0)).train()
    F.cross_entropy(off(tokens).flatten(0, 1), tokens.flatten()).backward()
    losses, metrics = off.pop_auxiliary()
    assert "mtp/loss" not in losses and not any(k.startswith("mtp/") for k in metrics)
    assert all(p.grad is None for p in off.mtp.parameters())  # not even computed

    none = build_model(_debug(n_mtp=0))
    assert none.mtp is None and not any(k.startswith("mtp.") for k in none.state_dict())
    assert not any(p.startswith("mtp.") for p in none.config.slots())
    none.load_state_dict({k: v for k, v in off.state_dict().items() if not k.startswith("mtp.")})
    none.train()
    torch.testing.assert_close(none(tokens), off(tokens), rtol=0, atol=0)
    assert "mtp/loss" not in none.pop_auxiliary()[0]


def test_mtp_never_changes_the_main_logits():
    model = build_model(_debug(n_mtp=2)).train()
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        before = model(tokens)
        for p in model.mtp.parameters():
            p.add_(torch.randn_like(p))
        after = model(tokens)
    assert torch.equal(before, after)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens), after)
    model.train()
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is None for p in model.mtp.parameters())  # the main loss never reaches MTP weights


def test_backward_through_mtp_reaches_its_weights_and_the_shared_embedding():
    model = build_model(_debug(n_mtp=2)).train()
    tokens = torch.randint(0, 256, (2, 24))
    main = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    losses, _ = model.pop_auxiliary()
    main.backward(retain_graph=True)
    emb_main_only = model.tok_embeddings.weight.grad.clone()
    out_main_only = model.output.weight.grad.clone()
    losses["mtp/loss"].backward()
    for name, p in model.mtp.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert not torch.allclose(model.tok_embeddings.weight.grad, emb_main_only)
    assert not torch.allclose(model.output.weight.grad, out_main_only)


def test_mtp_heads_learn_on_cpu():
    """A few AdamW steps on one batch drive the MTP loss down along with the LM loss."""
    torch.manual_seed(0)
    model = build_model(_debug(n_mtp=1, mtp_loss_weight=1.0)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (2, 33))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    first = None
    for _ in range(15):
        main = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        losses, metrics = model.pop_auxiliary()
        (main + sum(losses.values())).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        first = first or float(metrics["mtp/loss_1"])
    assert float(metrics["mtp/loss_1"]) < 0.6 * first


def test_hf_checkpoint_mtp_tensors_are_skipped_or_mapped_with_a_log_line(tmp_path, caplog):
    """A checkpoint with an MTP layer loads into n_mtp=0 (skipped, logged) and n_mtp=1 (mapped); a file
    written with MTP still loads in transformers, which ignores model.layers.{n_layers}."""
    import json
    import logging

    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel

    hf, hf_cfg = hf_deepseek(n_layers=2)
    checkpoint = {**hf.state_dict(), **_mtp_checkpoint(hf, MtpModel(hf, 1), 2)}
    adapter = DeepSeekV3Adapter()
    plain = adapter.config_from_hf(hf_cfg.to_dict())
    with caplog.at_level(logging.WARNING, logger="lockstep.models.deepseek_v3.hf"):
        state = adapter.state_from_hf(checkpoint, plain)
    assert not any(k.startswith("mtp.") for k in state)
    assert "skipping" in caplog.text and "model.layers.2+" in caplog.text and "model.n_mtp" in caplog.text
    caplog.clear()

    with_mtp = plain.replace(n_mtp=1)
    state = adapter.state_from_hf(checkpoint, with_mtp)
    model = build_model(with_mtp)
    model.load_state_dict(state, strict=True)
    assert "skipping" not in caplog.text

    with caplog.at_level(logging.WARNING, logger="lockstep.models.deepseek_v3.hf"):
        partial = adapter.state_from_hf(dict(hf.state_dict()), with_mtp)  # no MTP in the checkpoint
    assert "no MTP weights" in caplog.text and not any(k.startswith("mtp.") for k in partial)

    save_file({k: v.contiguous() for k, v in adapter.state_to_hf(model.state_dict(), with_mtp).items()},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(adapter.config_to_hf(with_mtp)))
    reloaded = DeepseekV3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = torch.randint(0, hf_cfg.vocab_size, (1, 12))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf(tokens).logits)
