"""Shared set-up of the DeepSeek-V4 tests: a tiny random lockstep model and transformers' twin."""

from __future__ import annotations

import dataclasses

import torch

from lockstep.models.common.transformer import build_model
from lockstep.models.deepseek_v4 import FLAVORS, DeepSeekV4Adapter


def tiny_config(**changes):
    return dataclasses.replace(FLAVORS["debug"](), **changes)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Make zero-initialised parameters (sinks, position biases, hyper-connection bases) non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith((".scale", "hc_scale")):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            hashed = name.startswith("layers.") and model.config.mlp_layer_types[int(name.split(".")[1])] == "hash_moe"
            if name.endswith("e_score_correction_bias") and not hashed:  # unused (and not saved) in hash layers
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            elif name.endswith("tid2eid"):  # a random (distinct-per-row) hash table
                n_experts = model.config.feed_forward.n_routed_experts
                b.copy_(torch.stack([torch.randperm(n_experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))


def pair(config=None, seed: int = 0):
    """(lockstep model, transformers model) with the same random weights, fp32, eval mode."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = config or tiny_config()
    model = build_model(config, seed=seed)
    randomize(model, seed)
    adapter = DeepSeekV4Adapter()
    hf_cfg = DeepseekV4Config(**{k: v for k, v in adapter.config_to_hf(config).items()
                                 if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = DeepseekV4ForCausalLM(hf_cfg).float().eval()
    missing, unexpected = hf.load_state_dict(hf_memory_state(model), strict=True)
    assert not missing and not unexpected
    return model.eval(), hf


def hf_memory_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """lockstep tensors under transformers' in-memory names (fused experts; hash layers lose the unused bias)."""
    from lockstep.models.deepseek_v4.hf import _EXPERTS, hf_name

    state, out = model.state_dict(), {}
    for name, t in state.items():
        m = _EXPERTS.match(name)
        if m:
            prefix = hf_name(m.group(1)) + ".mlp.experts."
            if m.group(2) == "w2":
                out[prefix + "down_proj"] = t
            elif m.group(2) == "w1":
                out[prefix + "gate_up_proj"] = torch.cat([t, state[name[:-2] + "w3"]], dim=1)
            continue
        layer = name.split(".")[1] if name.startswith("layers.") else None
        if name.endswith("feed_forward.e_score_correction_bias") and \
                model.config.mlp_layer_types[int(layer)] == "hash_moe":
            continue
        out[hf_name(name)] = t
    return out
