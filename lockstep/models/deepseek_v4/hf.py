"""Hugging Face interop for DeepSeek-V4 (``DeepseekV4ForCausalLM``, transformers 5.19).

Files are written in the layout transformers' ``save_pretrained`` writes (DeepSeek's original names,
:func:`disk_name`: ``attn.wq_a``, ``ffn.experts.{j}.w1``, ``hc_attn_fn``, ``head.weight``, ...); both
that layout and transformers' in-memory names (``DeepseekV4ForCausalLM.state_dict()``, :func:`hf_name`)
are read. In-memory names:

==============================================================  =============================================
HF                                                              lockstep
==============================================================  =============================================
model.embed_tokens / model.norm / lm_head / model.hc_head.*     tok_embeddings / norm / output / hc_head.*
model.layers.{i}.input_layernorm / post_attention_layernorm      layers.{i}.attention_norm / ffn_norm
model.layers.{i}.attn_hc.* / ffn_hc.*                           layers.{i}.attn_hc.* / ffn_hc.*
self_attn.{q_a_proj,q_a_norm,q_b_proj,kv_proj,kv_norm,...}      attention.{same names}, sinks
self_attn.compressor.{kv_proj,gate_proj,position_bias,kv_norm}  attention.compressor.{same}
self_attn.compressor.indexer.{kv_proj,gate_proj,position_bias,  attention.indexer.compressor.{same}
  kv_norm}
self_attn.compressor.indexer.{q_b_proj,scorer.weights_proj}     attention.indexer.{same}
mlp.gate.weight / e_score_correction_bias / tid2eid             feed_forward.gate.weight / e_score_... / tid2eid
mlp.experts.gate_up_proj [E, 2F, D] / down_proj [E, D, F]       feed_forward.experts cat(w1, w3) / w2
mlp.shared_experts.gate_proj / up_proj / down_proj              feed_forward.shared_experts.w1 / w3 / w2
==============================================================  =============================================

Hash-routed layers have no ``e_score_correction_bias`` in HF (lockstep keeps an unused zero one).
Config: ``rope_parameters`` ``main`` (plain) -> ``main_rope``, ``compress`` (plain or YaRN, the
released checkpoints' factor-16 YaRN with ``attention_factor`` 1) -> ``compress_rope``; MTP layers
are not read.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.rope_yarn import YarnRopeConfig
from lockstep.models.common.transformer import TransformerConfig, build_meta_model
from lockstep.models.deepseek_v4.model import FAMILY, DeepSeekV4Config
from lockstep.models.hf.yarn import yarn_rope_from_hf, yarn_rope_to_hf

_RENAMES = [  # lockstep prefix -> HF prefix, applied once each, in order
    (r"^tok_embeddings\.", "model.embed_tokens."), (r"^norm\.", "model.norm."), (r"^output\.", "lm_head."),
    (r"^hc_head\.", "model.hc_head."), (r"^layers\.", "model.layers."),
    (r"\.attention_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.attention\.indexer\.", ".self_attn.compressor.indexer."), (r"\.attention\.", ".self_attn."),
    (r"\.feed_forward\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.feed_forward\.tid2eid$", ".mlp.gate.tid2eid"), (r"\.feed_forward\.", ".mlp."),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."), (r"\.indexer\.compressor\.", ".indexer."),
]
_DISK = [  # lockstep -> the layout transformers' save_pretrained writes (DeepSeek's original names)
    (r"^tok_embeddings\.", "model.embed_tokens."), (r"^output\.", "head."), (r"^norm\.", "model.norm."),
    (r"^hc_head\.", "model.hc_head."), (r"^layers\.", "model.layers."), (r"\.attention_norm\.", ".attn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"), (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.attention\.sinks$", ".attn.attn_sink"), (r"\.indexer\.scorer\.", ".indexer."),
    (r"\.q_a_proj\.", ".wq_a."), (r"\.q_a_norm\.", ".q_norm."), (r"\.q_b_proj\.", ".wq_b."), (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."), (r"\.kv_norm\.", ".norm."), (r"\.position_bias$", ".ape"),
    (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."), (r"\.attention\.", ".attn."),
    (r"\.feed_forward\.e_score_correction_bias$", ".ffn.gate.bias"), (r"\.feed_forward\.tid2eid$", ".ffn.gate.tid2eid"),
    (r"\.feed_forward\.", ".ffn."),
]
_EXPERTS = re.compile(r"^(layers\.\d+)\.feed_forward\.experts\.(w1|w2|w3)$")


def _rename(name: str, table: list[tuple[str, str]]) -> str:
    for pattern, repl in table:
        name = re.sub(pattern, repl, name)
    return name


def hf_name(name: str) -> str:
    """transformers' in-memory name of lockstep tensor ``name`` (experts excepted: they are fused)."""
    return _rename(name, _RENAMES)


def disk_name(name: str) -> str:
    """The name transformers' ``save_pretrained`` gives lockstep tensor ``name`` (experts: per expert)."""
    return _rename(name, _DISK)


class DeepSeekV4Adapter:
    """HFAdapter for ``DeepseekV4ForCausalLM`` (``model_type`` ``deepseek_v4``)."""

    def config_from_hf(self, hf_config: dict[str, Any]) -> TransformerConfig:
        from transformers import DeepseekV4Config as HFConfig  # fills transformers' defaults and legacy fields

        hf = HFConfig(**{k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")})
        rp = hf.rope_parameters  # {"main": plain, "compress": plain or YaRN}, as transformers resolves them
        if rp["main"].get("rope_type", "default") != "default":
            raise ConfigError(f"config.json rope_parameters.main: rope_type {rp['main'].get('rope_type')!r}; "
                              "DeepSeek-V4's sliding-window blocks use plain RoPE")
        compress = yarn_rope_from_hf({"rope_parameters": dict(rp["compress"]),
                                      "max_position_embeddings": hf.max_position_embeddings}, FAMILY)
        rates = hf.compress_rates
        cfg = DeepSeekV4Config(
            flavor="hf", vocab_size=hf.vocab_size, dim=hf.hidden_size, n_layers=hf.num_hidden_layers,
            n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads, head_dim=hf.head_dim,
            rope_dim=hf.qk_rope_head_dim, compress_rope=compress, q_lora_rank=hf.q_lora_rank,
            main_rope=YarnRopeConfig(theta=float(rp["main"]["rope_theta"]), scaling="none"),
            o_groups=hf.o_groups, o_lora_rank=hf.o_lora_rank, sliding_window=hf.sliding_window,
            layer_types=list(hf.layer_types), csa_rate=rates["compressed_sparse_attention"],
            hca_rate=rates["heavily_compressed_attention"], index_n_heads=hf.index_n_heads,
            index_head_dim=hf.index_head_dim, index_topk=hf.index_topk, hc_mult=hf.hc_mult,
            hc_sinkhorn_iters=hf.hc_sinkhorn_iters, hc_eps=hf.hc_eps, mlp_layer_types=list(hf.mlp_layer_types),
            swiglu_limit=hf.swiglu_limit, norm_eps=hf.rms_norm_eps, max_seq_len=hf.max_position_embeddings,
            ffn_dim=hf.moe_intermediate_size,
            feed_forward=MoEConfig(n_routed_experts=hf.n_routed_experts, n_activated=hf.num_experts_per_tok,
                                   moe_ffn_dim=hf.moe_intermediate_size, n_shared_experts=hf.n_shared_experts,
                                   score_func="sigmoid", norm_topk_prob=hf.norm_topk_prob,
                                   routed_scaling_factor=hf.routed_scaling_factor))
        if hf.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"config.json scoring_func: {hf.scoring_func!r}; lockstep's deepseek_v4 routes with "
                              "'sqrtsoftplus'")
        if hf.n_shared_experts != 1:
            raise ConfigError("config.json n_shared_experts: DeepSeek-V4 has exactly one shared expert")
        if hf.tie_word_embeddings:
            raise ConfigError("config.json tie_word_embeddings: DeepSeek-V4 does not tie the output head")
        cfg.validate()
        return cfg

    def config_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        if not isinstance(config, DeepSeekV4Config):
            raise ConfigError("model.family: the deepseek_v4 HF adapter needs a DeepSeekV4Config")
        c, moe = config, config.feed_forward
        return {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": c.vocab_size, "hidden_size": c.dim, "num_hidden_layers": c.n_layers,
            "num_attention_heads": c.n_heads, "num_key_value_heads": 1, "head_dim": c.head_dim,
            "partial_rotary_factor": c.rope_dim / c.head_dim, "rope_theta": c.main_rope.theta,
            "compress_rope_theta": c.compress_rope.theta,
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": c.main_rope.theta,
                                         "partial_rotary_factor": c.rope_dim / c.head_dim},
                                "compress": {**yarn_rope_to_hf(c.compress_rope, FAMILY),
                                             "partial_rotary_factor": c.rope_dim / c.head_dim}},
            "q_lora_rank": c.q_lora_rank, "o_groups": c.o_groups,
            "o_lora_rank": c.o_lora_rank, "sliding_window": c.sliding_window, "layer_types": list(c.layer_types),
            "compress_rates": {"compressed_sparse_attention": c.csa_rate,
                               "heavily_compressed_attention": c.hca_rate},
            "index_n_heads": c.index_n_heads, "index_head_dim": c.index_head_dim, "index_topk": c.index_topk,
            "hc_mult": c.hc_mult, "hc_sinkhorn_iters": c.hc_sinkhorn_iters, "hc_eps": c.hc_eps,
            "mlp_layer_types": list(c.mlp_layer_types), "swiglu_limit": c.swiglu_limit, "rms_norm_eps": c.norm_eps,
            "max_position_embeddings": c.max_seq_len, "n_routed_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.n_activated, "moe_intermediate_size": moe.moe_ffn_dim,
            "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": moe.norm_topk_prob,
            "routed_scaling_factor": moe.routed_scaling_factor, "tie_word_embeddings": False,
        }

    def _lockstep_names(self, config: TransformerConfig) -> list[str]:
        return list(build_meta_model(config).state_dict().keys())

    def _lockstep_names(self, config: TransformerConfig) -> list[str]:
        return list(build_meta_model(config).state_dict().keys())

    def state_to_hf(self, state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
        """The layout transformers' ``save_pretrained`` writes (and ``from_pretrained`` reads)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            m = _EXPERTS.match(name)
            if m:
                prefix = disk_name(m.group(1))
                for j in range(t.shape[0]):
                    out[f"{prefix}.ffn.experts.{j}.{m.group(2)}.weight"] = t[j]
                continue
            i = re.match(r"^layers\.(\d+)\.feed_forward\.e_score_correction_bias$", name)
            if i and config.mlp_layer_types[int(i.group(1))] == "hash_moe":
                continue  # unused by hash routing; HF's hash router has no such buffer
            out[disk_name(name)] = t
        return out

    def state_from_hf(self, hf_state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
        """Reads the ``save_pretrained`` layout or transformers' in-memory one (fused experts)."""
        out: dict[str, torch.Tensor] = {}
        missing: list[str] = []
        used: set[str] = set()
        n_experts = config.feed_forward.n_routed_experts
        for name in self._lockstep_names(config):
            m = _EXPERTS.match(name)
            if m:
                disk = [f"{disk_name(m.group(1))}.ffn.experts.{j}.{m.group(2)}.weight" for j in range(n_experts)]
                fused = f"{hf_name(m.group(1))}.mlp.experts." + ("down_proj" if m.group(2) == "w2" else "gate_up_proj")
                if all(k in hf_state for k in disk):
                    out[name] = torch.stack([hf_state[k] for k in disk])
                    used.update(disk)
                elif fused in hf_state:
                    t, half = hf_state[fused], hf_state[fused].shape[1] // 2
                    out[name] = t if m.group(2) == "w2" else (t[:, :half] if m.group(2) == "w1" else t[:, half:])
                    used.add(fused)
                else:
                    missing.append(disk[0])
                continue
            key = next((k for k in (disk_name(name), hf_name(name)) if k in hf_state), None)
            if key is not None:
                out[name] = hf_state[key]
                used.add(key)
            elif name.endswith("feed_forward.e_score_correction_bias"):
                out[name] = torch.zeros(n_experts, dtype=torch.float32)
            else:
                missing.append(disk_name(name))
        unknown = sorted(k for k in hf_state if k not in used and not re.match(r"^(model\.)?mtp\.", k))
        if missing or unknown:
            raise ConfigError(f"deepseek_v4 checkpoint: missing tensors {missing[:8]}, unknown tensors {unknown[:8]}")
        return out


__all__ = ["DeepSeekV4Adapter", "disk_name", "hf_name", "FAMILY"]
