"""Hugging Face interop for DeepSeek-V3 / Kimi-K2 (``DeepseekV3ForCausalLM``, transformers 5.19).

Config: ``config.json`` fields <-> :class:`DeepSeekV3Config` (v5 ``rope_parameters`` or the legacy
``rope_theta`` + ``rope_scaling`` of the released checkpoints are read; ``rope_parameters`` is written).
``model_type`` ``kimi_k2`` reads as the same architecture; we always write ``deepseek_v3``, which
transformers loads natively.

Tensors, as ``save_pretrained`` writes them (v5 reverts its in-memory fused experts on save):

=============================================================  ==========================================
HF                                                             lockstep
=============================================================  ==========================================
model.embed_tokens.weight / model.norm.weight / lm_head.weight tok_embeddings / norm / output .weight
model.layers.{i}.input_layernorm / post_attention_layernorm    layers.{i}.attention_norm / ffn_norm
self_attn.q_proj | q_a_proj, q_a_layernorm, q_b_proj           attention.wq | wq_a, q_norm, wq_b
self_attn.kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj attention.wkv_a, kv_norm, wkv_b, wo
mlp.gate_proj / up_proj / down_proj (dense layers)             feed_forward.w1 / w3 / w2
mlp.gate.weight, mlp.gate.e_score_correction_bias              feed_forward.gate.weight, .e_score_correction_bias
mlp.experts.{j}.gate_proj / up_proj / down_proj .weight        feed_forward.experts.w1[j] / w3[j] / w2[j]
mlp.shared_experts.gate_proj / up_proj / down_proj             feed_forward.shared_experts.w1 / w3 / w2
=============================================================  ==========================================

The in-memory fused layout (``mlp.experts.gate_up_proj [E, 2F, D]`` = cat(w1, w3) on dim 1,
``mlp.experts.down_proj [E, D, F]``) is accepted on load too.

MTP: transformers' ``DeepseekV3ForCausalLM`` has no MTP in its forward; the released DeepSeek-V3
checkpoint keeps its MTP module as ``model.layers.{n_layers + k}`` (``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm``, ``shared_head.head``, ``embed_tokens`` and a decoder layer), which
transformers ignores on load. We map those to ``mtp.{k}`` (``proj`` = ``eh_proj``, ``norm`` =
``shared_head.norm``, ``block`` = the decoder layer; the embedding and head copies are shared and
skipped) when the config has ``n_mtp > k``, skip them with a log line otherwise, and write them in
that layout (with the embedding/head copies) when saving a model with ``n_mtp > 0``.
``config_from_hf`` builds ``n_mtp = 0`` (the architecture transformers runs); set ``model.n_mtp``
to train MTP from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.mla import MLAConfig
from lockstep.models.common.mlp import SwiGLUConfig
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.rope_yarn import YarnRopeConfig, softmax_mscale_of
from lockstep.models.hf.yarn import yarn_rope_from_hf, yarn_rope_to_hf
from lockstep.models.common.transformer import TransformerConfig
from lockstep.models.deepseek_v3.model import DeepSeekV3Config, deepseek_v3_config

log = logging.getLogger(__name__)

_ATTN = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
         "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MTP_EXTRA = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "proj.weight": "eh_proj.weight",
              "norm.weight": "shared_head.norm.weight"}
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def _rope_from_hf(hf: dict[str, Any]) -> YarnRopeConfig:
    return yarn_rope_from_hf(hf, "deepseek_v3")


def _rope_to_hf(rope: Any) -> dict[str, Any]:
    return yarn_rope_to_hf(rope, "deepseek_v3")


def _uniform(config: DeepSeekV3Config) -> None:
    """config_to_hf can express one attention, one MoE and one dense config for all layers; per-layer
    overrides of kernels (attention backend, experts_impl) or training-only knobs are fine."""
    slots = config.slots()
    attention = slots["layers.0.attention"]
    for path, cfg in slots.items():
        kind = path.rsplit(".", 1)[-1]
        if kind == "attention":
            same = isinstance(cfg, MLAConfig) and dataclasses.replace(cfg, backend=attention.backend) == attention
        elif kind == "feed_forward":
            moe = not path.startswith("layers.") or config.is_moe_layer(int(path.split(".")[1]))
            want = config.feed_forward if moe else config.dense_feed_forward
            if isinstance(cfg, MoEConfig) and isinstance(want, MoEConfig):
                cfg = dataclasses.replace(cfg, experts_impl=want.experts_impl, routing=want.routing,
                                          bias_update_speed=want.bias_update_speed,
                                          seq_aux_loss_coef=want.seq_aux_loss_coef)
            same = cfg == want
        else:
            continue
        if not same:
            raise ConfigError(f"model.overrides: {path} differs from the model-wide {kind} config, which a HF "
                              "DeepseekV3 config.json cannot express")


class DeepSeekV3Adapter:
    """HFAdapter for ``DeepseekV3ForCausalLM`` checkpoints (``deepseek_v3`` and ``kimi_k2`` model types)."""

    def config_from_hf(self, hf_config: dict[str, Any]) -> TransformerConfig:
        hf = hf_config
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json hidden_act {act!r}: only silu is supported")
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"config.json scoring_func {hf['scoring_func']!r}: DeepseekV3 routes with sigmoid")
        if hf.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"config.json moe_layer_freq {hf['moe_layer_freq']}: only 1 is supported (as HF)")
        n_heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or n_heads
        if kv_heads != n_heads:
            raise ConfigError(f"config.json num_key_value_heads {kv_heads} != num_attention_heads {n_heads}: "
                              "MLA expands keys and values for every head")
        rope = _rope_from_hf(hf)
        cfg = deepseek_v3_config(
            "hf", vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=n_heads, ffn_dim=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
            norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
            moe_ffn_dim=hf["moe_intermediate_size"], n_shared_experts=hf.get("n_shared_experts") or 0,
            n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            first_k_dense_replace=hf.get("first_k_dense_replace") or 0, n_mtp=0, rope=rope,
        )
        attention = dataclasses.replace(cfg.attention, rope_interleave=bool(hf.get("rope_interleave", True)),
                                        qkv_bias=bool(hf.get("attention_bias", False)))
        cfg = dataclasses.replace(cfg, attention=attention)
        cfg.validate()
        return cfg

    def config_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        if not isinstance(config, DeepSeekV3Config) or not isinstance(config.attention, MLAConfig):
            raise ConfigError("model: the deepseek_v3 HF adapter needs a DeepSeekV3Config with MLA attention")
        config.validate()
        _uniform(config)
        att, moe = config.attention, config.feed_forward
        if not isinstance(moe, MoEConfig) or moe.score_func != "sigmoid":
            raise ConfigError("model.feed_forward: HF DeepseekV3 needs a sigmoid-scored MoEConfig")
        if att.softmax_mscale and abs(att.softmax_mscale - softmax_mscale_of(config.rope)) > 1e-12:
            raise ConfigError("model.attention.softmax_mscale: HF derives it from rope_parameters; leave it at 0")
        if att.latent_norm_eps != 1e-6:
            raise ConfigError("model.attention.latent_norm_eps: HF DeepseekV3 fixes the latent norms' eps at 1e-6")
        if not isinstance(config.dense_feed_forward, SwiGLUConfig):
            raise ConfigError("model.dense_feed_forward: HF DeepseekV3's dense layers are SwiGLU MLPs")
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": config.vocab_size,
            "hidden_size": config.dim,
            "intermediate_size": config.ffn_dim,
            "moe_intermediate_size": moe.moe_ffn_dim or config.ffn_dim,
            "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.n_heads,
            "n_shared_experts": moe.n_shared_experts,
            "n_routed_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.n_activated,
            "routed_scaling_factor": moe.routed_scaling_factor,
            "n_group": moe.n_group,
            "topk_group": moe.topk_group,
            "norm_topk_prob": moe.norm_topk_prob,
            "first_k_dense_replace": config.first_k_dense_replace,
            "q_lora_rank": att.q_lora_rank or None,
            "kv_lora_rank": att.kv_lora_rank,
            "qk_nope_head_dim": att.qk_nope_head_dim,
            "qk_rope_head_dim": att.qk_rope_head_dim,
            "v_head_dim": att.v_head_dim,
            "head_dim": att.qk_rope_head_dim,
            "rope_interleave": att.rope_interleave,
            "attention_bias": att.qkv_bias,
            "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps,
            "tie_word_embeddings": config.tie_embeddings,
            "rope_parameters": _rope_to_hf(config.rope),
            "num_nextn_predict_layers": config.n_mtp,
        }

    # ----------------------------------------------------------------------------------- tensors
    def _block_names(self, config: DeepSeekV3Config, ls: str, hf: str, moe: bool) -> dict[str, str]:
        """lockstep name -> HF name of a block's 1:1 tensors (experts excluded)."""
        att = config.attention
        names = {f"{ls}.attention_norm.weight": f"{hf}.input_layernorm.weight",
                 f"{ls}.ffn_norm.weight": f"{hf}.post_attention_layernorm.weight"}
        mods = ["wq_a", "q_norm", "wq_b"] if att.q_lora_rank else ["wq"]
        for m in [*mods, "wkv_a", "kv_norm", "wkv_b", "wo"]:
            names[f"{ls}.attention.{m}.weight"] = f"{hf}.self_attn.{_ATTN[m]}.weight"
        if att.qkv_bias:
            for m in (["wq_a"] if att.q_lora_rank else []) + ["wkv_a", "wo"]:
                names[f"{ls}.attention.{m}.bias"] = f"{hf}.self_attn.{_ATTN[m]}.bias"
        if moe:
            names[f"{ls}.feed_forward.gate.weight"] = f"{hf}.mlp.gate.weight"
            names[f"{ls}.feed_forward.e_score_correction_bias"] = f"{hf}.mlp.gate.e_score_correction_bias"
            if config.feed_forward.n_shared_experts:
                for m, h in _MLP.items():
                    names[f"{ls}.feed_forward.shared_experts.{m}.weight"] = f"{hf}.mlp.shared_experts.{h}.weight"
        else:
            for m, h in _MLP.items():
                names[f"{ls}.feed_forward.{m}.weight"] = f"{hf}.mlp.{h}.weight"
        return names

    def _blocks(self, config: DeepSeekV3Config, n_mtp: int) -> list[tuple[str, str, bool]]:
        """(lockstep prefix, HF prefix, is MoE) of every block, MTP blocks last."""
        out = [(f"layers.{i}", f"model.layers.{i}", config.is_moe_layer(i)) for i in range(config.n_layers)]
        out += [(f"mtp.{k}.block", f"model.layers.{config.n_layers + k}", True) for k in range(n_mtp)]
        return out

    def _names(self, config: DeepSeekV3Config, n_mtp: int) -> dict[str, str]:
        names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
        if not config.tie_embeddings:
            names["output.weight"] = "lm_head.weight"
        for ls, hf, moe in self._blocks(config, n_mtp):
            names.update(self._block_names(config, ls, hf, moe))
        for k in range(n_mtp):
            for ls, hf in _MTP_EXTRA.items():
                names[f"mtp.{k}.{ls}"] = f"model.layers.{config.n_layers + k}.{hf}"
        return names

    def state_from_hf(self, hf_state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
        assert isinstance(config, DeepSeekV3Config)
        n_layers, n_mtp = config.n_layers, config.n_mtp
        from_hf = {h: ls for ls, h in self._names(config, n_mtp).items()}
        moe_prefix = {hf: ls for ls, hf, moe in self._blocks(config, n_mtp) if moe}
        n_experts = config.feed_forward.n_routed_experts if isinstance(config.feed_forward, MoEConfig) else 0
        expert_re = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(?:(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
                               r"|(gate_up_proj|down_proj))$")
        state: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        unknown, skipped_mtp = [], []
        for name, tensor in hf_state.items():
            if name in from_hf:
                state[from_hf[name]] = tensor
                continue
            layer = re.match(r"^model\.layers\.(\d+)\.", name)
            idx = int(layer.group(1)) if layer else -1
            if idx >= n_layers + n_mtp:
                skipped_mtp.append(name)
                continue
            if idx >= n_layers and name.split(".", 3)[3] in _MTP_SHARED:
                continue  # the MTP module's copies of the shared embedding / head
            m = expert_re.match(name)
            if m and m.group(1) in moe_prefix:
                slot = experts.setdefault(moe_prefix[m.group(1)], {})
                if m.group(2) is not None:
                    w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[m.group(3)]
                    slot.setdefault(w, {})[int(m.group(2))] = tensor
                elif m.group(4) == "gate_up_proj":
                    w1, w3 = tensor.chunk(2, dim=1)
                    slot["w1"] = dict(enumerate(w1.unbind(0)))
                    slot["w3"] = dict(enumerate(w3.unbind(0)))
                else:
                    slot["w2"] = dict(enumerate(tensor.unbind(0)))
                continue
            if name == "lm_head.weight" and config.tie_embeddings:
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue
            unknown.append(name)
        if unknown:
            raise ValueError(f"deepseek_v3: {len(unknown)} HF tensors have no lockstep counterpart: "
                             f"{sorted(unknown)[:20]}{' ...' if len(unknown) > 20 else ''}")
        if skipped_mtp:
            first = min(int(n.split(".")[2]) for n in skipped_mtp)
            log.warning("deepseek_v3: skipping %d multi-token-prediction tensors (model.layers.%d+; HF "
                        "DeepseekV3ForCausalLM has no MTP forward) because model.n_mtp=%d; set model.n_mtp to "
                        "load them", len(skipped_mtp), first, n_mtp)
        for ls, slot in experts.items():
            for w in ("w1", "w2", "w3"):
                got = slot.get(w, {})
                if sorted(got) != list(range(n_experts)):
                    raise ValueError(f"deepseek_v3: {ls}.feed_forward.experts.{w} lacks experts "
                                     f"{sorted(set(range(n_experts)) - set(got))} in the HF checkpoint")
                state[f"{ls}.feed_forward.experts.{w}"] = torch.stack([got[j] for j in range(n_experts)])
        expected = set(self._names(config, n_mtp)) | {
            f"{ls}.feed_forward.experts.{w}" for ls in moe_prefix.values() for w in ("w1", "w2", "w3")}
        missing = sorted(expected - set(state))
        missing_mtp = [k for k in missing if k.startswith("mtp.")]
        if missing_mtp:
            log.warning("deepseek_v3: the checkpoint has no MTP weights for %d tensors (e.g. %s); model.n_mtp=%d "
                        "modules keep their initialisation", len(missing_mtp), missing_mtp[0], n_mtp)
        missing = [k for k in missing if not k.startswith("mtp.")]
        if missing:
            raise ValueError(f"deepseek_v3: the HF checkpoint lacks {len(missing)} tensors: {missing[:20]}")
        if config.tie_embeddings:  # a tied model's state_dict names the shared matrix twice
            state["output.weight"] = state["tok_embeddings.weight"]
        return state

    def state_to_hf(self, state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
        assert isinstance(config, DeepSeekV3Config)
        n_layers, n_mtp = config.n_layers, config.n_mtp
        to_hf = self._names(config, n_mtp)
        moe_prefix = {ls: hf for ls, hf, moe in self._blocks(config, n_mtp) if moe}
        out: dict[str, torch.Tensor] = {}
        unknown = []
        for name, tensor in state.items():
            if name in to_hf:
                out[to_hf[name]] = tensor
                continue
            m = re.match(r"^(.*)\.feed_forward\.experts\.(w1|w2|w3)$", name)
            if m and m.group(1) in moe_prefix:
                h = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[m.group(2)]
                for j, w in enumerate(tensor.unbind(0)):
                    out[f"{moe_prefix[m.group(1)]}.mlp.experts.{j}.{h}.weight"] = w.contiguous()
                continue
            if name == "output.weight" and config.tie_embeddings:
                continue
            unknown.append(name)
        if unknown:
            raise ValueError(f"deepseek_v3: {len(unknown)} lockstep tensors have no HF counterpart: "
                             f"{sorted(unknown)[:20]}")
        for k in range(n_mtp):  # DeepSeek's MTP layout carries its own copies of the shared embedding and head
            prefix = f"model.layers.{n_layers + k}"  # (copies: safetensors refuses tensors sharing storage)
            out[f"{prefix}.embed_tokens.weight"] = state["tok_embeddings.weight"].clone()
            head = state.get("output.weight", state["tok_embeddings.weight"])
            out[f"{prefix}.shared_head.head.weight"] = head.clone()
        return out
