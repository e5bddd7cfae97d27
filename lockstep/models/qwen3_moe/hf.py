"""Qwen3-MoE <-> Hugging Face ``qwen3_moe`` checkpoints (``Qwen3MoeForCausalLM``).

Tensor names on disk (what ``save_pretrained`` writes in transformers 5.x and what the Qwen hub
checkpoints hold) keep one Linear per expert::

    model.layers.{i}.mlp.gate.weight                          [E, D]   -> feed_forward.gate.weight
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight         [F, D]   -> feed_forward.experts.w1[e]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight           [F, D]   -> feed_forward.experts.w3[e]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight         [D, F]   -> feed_forward.experts.w2[e]

transformers 5.x fuses them *in memory* (``mlp.experts.gate_up_proj [E, 2F, D]``, gate rows first,
and ``mlp.experts.down_proj [E, D, F]``); ``state_from_hf`` reads that layout too, so a live
``model.state_dict()`` converts directly. Dense layers (``mlp_only_layers`` / ``decoder_sparse_step``)
use ``mlp.{gate,up,down}_proj.weight``. Attention and norms are the Qwen3 names.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.mlp import SwiGLUConfig
from lockstep.models.common.norm import RMSNormConfig
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.transformer import TransformerConfig
from lockstep.models.hf.dense import IGNORED_HF_TENSORS, DenseHFAdapter, lockstep_to_hf_name, rope_from_hf, rope_to_hf
from lockstep.models.qwen3_moe.config import Qwen3MoETransformerConfig

# Attention, norms, embeddings and dense MLPs are named as in dense Qwen3 (lockstep.models.hf.dense).
_BLOCK = ["attention_norm.weight", "ffn_norm.weight", "attention.wq.weight", "attention.wk.weight",
          "attention.wv.weight", "attention.wo.weight", "attention.q_norm.weight", "attention.k_norm.weight"]
_DENSE = ["feed_forward.w1.weight", "feed_forward.w3.weight", "feed_forward.w2.weight"]
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Config checks shared with dense Qwen3 (activation, biases, quantisation, sliding windows).
_DENSE_CHECKS = DenseHFAdapter(family="qwen3_moe", model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
                               qk_norm=True)


def _moe_layers(config: TransformerConfig) -> dict[int, MoEConfig]:
    """Layer index -> MoE config of every layer the lockstep model builds as MoE."""
    slots = config.slots()
    return {i: ff for i in range(config.n_layers)
            if isinstance(ff := slots[f"layers.{i}.feed_forward"], MoEConfig)}


class Qwen3MoEAdapter:
    """``HFAdapter`` for ``model_type: qwen3_moe``."""

    # ---- config -------------------------------------------------------------------------------

    def config_from_hf(self, hf_config: dict[str, Any]) -> Qwen3MoETransformerConfig:
        hf = hf_config
        if hf.get("model_type", "qwen3_moe") != "qwen3_moe":
            raise ConfigError(f"config.json model_type {hf['model_type']!r}: this adapter reads 'qwen3_moe'")
        _DENSE_CHECKS._check_supported(hf)
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
                   if hf.get(k) is None]
        if missing:
            raise ConfigError(f"config.json lacks required field(s) {missing}")
        n_experts = hf.get("num_experts", hf.get("num_local_experts", 128))
        if not n_experts:
            raise ConfigError("config.json num_experts=0 is a dense model; load it as family qwen3")
        dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
        moe = MoEConfig(
            n_routed_experts=n_experts,
            n_activated=hf.get("num_experts_per_tok", 8),
            moe_ffn_dim=hf.get("moe_intermediate_size", 768),
            score_func="softmax",
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )
        return Qwen3MoETransformerConfig(
            family="qwen3_moe",
            flavor="hf",
            vocab_size=hf["vocab_size"],
            dim=dim,
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads", n_heads),
            head_dim=hf.get("head_dim") or dim // n_heads,
            ffn_dim=hf.get("intermediate_size", 6144),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_seq_len=hf.get("max_position_embeddings", 32768),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range", 0.02),
            rope=rope_from_hf(hf, default_theta=10000.0),
            attention=AttentionConfig(qk_norm=True),
            feed_forward=moe,
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=list(hf.get("mlp_only_layers") or []),
        )

    def config_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        moe = self._check_representable(config)
        rope = rope_to_hf(config.rope)
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": config.vocab_size,
            "hidden_size": config.dim,
            "intermediate_size": config.ffn_dim,
            "moe_intermediate_size": moe.moe_ffn_dim or config.ffn_dim,
            "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.n_kv_heads,
            "head_dim": config.resolved_head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len,
            "initializer_range": config.init_std,
            "rms_norm_eps": config.norm_eps,
            "tie_word_embeddings": config.tie_embeddings,
            "rope_parameters": rope,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "decoder_sparse_step": getattr(config, "decoder_sparse_step", 1),
            "mlp_only_layers": list(getattr(config, "mlp_only_layers", [])),
            "num_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.n_activated,
            "norm_topk_prob": moe.norm_topk_prob,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }

    def _check_representable(self, config: TransformerConfig) -> MoEConfig:
        """The one MoEConfig all MoE layers share; ConfigError naming what HF qwen3_moe cannot express."""
        slots = config.slots()
        is_moe = getattr(config, "is_moe_layer", lambda i: True)
        moe: MoEConfig | None = None
        for i in range(config.n_layers):
            ff = slots[f"layers.{i}.feed_forward"]
            want_moe = is_moe(i)
            if want_moe != isinstance(ff, MoEConfig) or (not want_moe and type(ff) is not SwiGLUConfig):
                raise ConfigError(f"model layers.{i}.feed_forward: {type(ff).__name__} does not match the "
                                  f"decoder_sparse_step/mlp_only_layers layout HF qwen3_moe uses")
            if want_moe:
                if moe is not None and ff != moe:
                    raise ConfigError(f"model layers.{i}.feed_forward: HF qwen3_moe needs one MoE config for all layers")
                moe = ff
            attn = slots[f"layers.{i}.attention"]
            if not attn.qk_norm or attn.qkv_bias:
                raise ConfigError(f"model layers.{i}.attention: qwen3_moe needs qk_norm=True and qkv_bias=False")
        for path, norm in slots.items():
            if path.endswith("norm") and not (type(norm) is RMSNormConfig and norm.eps in (0.0, config.norm_eps)):
                raise ConfigError(f"model {path}: HF qwen3_moe has RMSNorm with eps=norm_eps only")
        if moe is None:
            raise ConfigError("model: no MoE layer; a dense model is family qwen3")
        if config.rope.scaling != "none":
            raise ConfigError(f"model.rope.scaling: {config.rope.scaling!r} is not expressible in qwen3_moe")
        unsupported = {
            "score_func": (moe.score_func, "softmax"), "n_shared_experts": (moe.n_shared_experts, 0),
            "routed_scaling_factor": (moe.routed_scaling_factor, 1.0), "n_group": (moe.n_group, 1),
            "routing": (moe.routing, "learned"),
        }
        for name, (value, needed) in unsupported.items():
            if value != needed:
                raise ConfigError(f"model.feed_forward.{name}: HF qwen3_moe needs {needed!r}, got {value!r}")
        return moe

    # ---- state dict ---------------------------------------------------------------------------

    def state_from_hf(self, hf_state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
        remaining = {k: v for k, v in hf_state.items() if not IGNORED_HF_TENSORS.search(k)}
        out: dict[str, torch.Tensor] = {}
        missing: list[str] = []
        moe_layers = _moe_layers(config)

        def take(hf_name: str, ls_name: str) -> None:
            if hf_name in remaining:
                out[ls_name] = remaining.pop(hf_name)
            else:
                missing.append(hf_name)

        if config.tie_embeddings:
            head = remaining.pop("lm_head.weight", None)
            embed = remaining.get("model.embed_tokens.weight")
            if embed is None and head is not None:
                remaining["model.embed_tokens.weight"] = head  # a checkpoint that kept only the head
            elif head is not None and not torch.equal(head, embed):
                raise ConfigError("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
        for name in ("tok_embeddings.weight", "norm.weight") + (() if config.tie_embeddings else ("output.weight",)):
            take(lockstep_to_hf_name(name), name)
        if config.tie_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        for i in range(config.n_layers):
            hf_p, ls_p = f"model.layers.{i}.", f"layers.{i}."
            for name in _BLOCK + ([] if i in moe_layers else _DENSE):
                take(lockstep_to_hf_name(ls_p + name), ls_p + name)
            if i not in moe_layers:
                continue
            n_experts = moe_layers[i].n_routed_experts
            take(hf_p + "mlp.gate.weight", ls_p + "feed_forward.gate.weight")
            device = out[ls_p + "feed_forward.gate.weight"].device if ls_p + "feed_forward.gate.weight" in out else "cpu"
            out[ls_p + "feed_forward.e_score_correction_bias"] = torch.zeros(n_experts, dtype=torch.float32, device=device)
            experts = hf_p + "mlp.experts."
            if experts + "gate_up_proj" in remaining:  # transformers' fused in-memory layout
                gate_up = remaining.pop(experts + "gate_up_proj")
                w1, w3 = gate_up.chunk(2, dim=1)
                out[ls_p + "feed_forward.experts.w1"] = w1.contiguous()
                out[ls_p + "feed_forward.experts.w3"] = w3.contiguous()
                take(experts + "down_proj", ls_p + "feed_forward.experts.w2")
                continue
            for ls_w, proj in _EXPERT_PROJ.items():
                names = [f"{experts}{e}.{proj}.weight" for e in range(n_experts)]
                absent = [n for n in names if n not in remaining]
                if absent:
                    missing.extend(absent)
                    continue
                out[f"{ls_p}feed_forward.experts.{ls_w}"] = torch.stack([remaining.pop(n) for n in names])
        if missing or remaining:
            raise ConfigError(
                "qwen3_moe checkpoint does not match the config: "
                + (f"missing {_summary(missing)}" if missing else "")
                + ("; " if missing and remaining else "")
                + (f"unexpected {_summary(sorted(remaining))}" if remaining else "")
            )
        return out

    def state_to_hf(self, state: dict[str, torch.Tensor], config: TransformerConfig,
                    fused_experts: bool = False) -> dict[str, torch.Tensor]:
        """lockstep -> HF names; per-expert tensors as on disk, or transformers' in-memory fused
        layout with ``fused_experts=True``. Per-expert slices are copies (safetensors refuses
        tensors that share storage); other tensors are the state's own."""
        moe_layers = _moe_layers(config)
        names = ["tok_embeddings.weight", "norm.weight"] + ([] if config.tie_embeddings else ["output.weight"])
        out: dict[str, torch.Tensor] = {lockstep_to_hf_name(n): state[n] for n in names}
        for i in range(config.n_layers):
            hf_p, ls_p = f"model.layers.{i}.", f"layers.{i}."
            for name in _BLOCK + ([] if i in moe_layers else _DENSE):
                out[lockstep_to_hf_name(ls_p + name)] = state[ls_p + name]
            if i not in moe_layers:
                continue
            bias = state.get(ls_p + "feed_forward.e_score_correction_bias")
            if bias is not None and not bias.is_meta and bool(bias.any()):
                raise ConfigError(f"{ls_p}feed_forward.e_score_correction_bias is non-zero; HF qwen3_moe "
                                  "routing has no selection bias, so the exported model would route differently")
            out[hf_p + "mlp.gate.weight"] = state[ls_p + "feed_forward.gate.weight"]
            w = {k: state[f"{ls_p}feed_forward.experts.{k}"] for k in _EXPERT_PROJ}
            if fused_experts:
                out[hf_p + "mlp.experts.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
                out[hf_p + "mlp.experts.down_proj"] = w["w2"]
                continue
            for ls_w, proj in _EXPERT_PROJ.items():
                for e in range(w[ls_w].shape[0]):
                    out[f"{hf_p}mlp.experts.{e}.{proj}.weight"] = w[ls_w][e].clone()
        return out


def _summary(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"{len(names)} tensor(s): {shown}" + (", ..." if len(names) > limit else "")
