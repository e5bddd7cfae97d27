"""A lockstep model as a vLLM model: lockstep's own modules, vLLM's paged attention under them.

:class:`LockstepForCausalLM` is registered with vLLM as an out-of-tree architecture
(:func:`lockstep.vllm.register`). vLLM builds it from the ``lockstep_model`` entry of the
``config.json`` :mod:`lockstep.vllm.model_dir` writes: the lockstep ``TransformerConfig``, built with
:func:`~lockstep.models.common.transformer.build_model`, so every block, norm, MLP, MoE and rotary
embedding is lockstep's module, unchanged.

Attention plugs in where lockstep's own engine plugs its paged cache in: the ``cache`` argument of
``Transformer.trunk`` (``cache.layer(name).attend(...)`` / ``attend_latent(...)``, see
:mod:`lockstep.generate.cache`). Here that cache is :class:`VllmStepCache`: one vLLM ``Attention``
layer per lockstep attention layer, which stores the new keys/values in vLLM's paged KV cache and
attends with vLLM's kernel over the step's metadata (vLLM's forward context). vLLM hands the model
one flat batch of ``N`` tokens from every scheduled sequence; the trunk runs it as ``[1, N]``.

Head sizes: vLLM's CPU kernel takes head sizes 32, 64, 80, ... (:data:`CPU_HEAD_SIZES`); a head of
another size is zero-padded up to the next one (zeros add nothing to q.k, and the padded value
columns are dropped), with the softmax scale of the true size. Multi-head latent attention
(DeepSeek-V3) runs as one shared key/value head over the latent: keys are the latents, values their
first ``kv_lora_rank`` columns, the same function lockstep's cache computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lockstep.generate.cache import LayerLayout, layer_layouts
from lockstep.models.common.transformer import Transformer, TransformerConfig, build_model
from lockstep.models.hf.config_io import config_from_dict

#: head sizes vLLM 0.32's CPU attention kernel supports (CPUAttentionBackend.get_supported_head_sizes)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: the config.json key holding the lockstep model config
CONFIG_KEY = "lockstep_model"


def padded_head_size(size: int) -> int:
    """The smallest head size vLLM's CPU kernel takes that holds ``size``."""
    for supported in CPU_HEAD_SIZES:
        if supported >= size:
            return supported
    raise ValueError(f"attention head size {size} is larger than vLLM's CPU kernel supports ({CPU_HEAD_SIZES[-1]})")


def check_supported(model: Transformer) -> dict[str, LayerLayout]:
    """The cache layout of every attention layer; a clear error for what vLLM cannot run here."""
    family = model.config.family
    for name, block in model.layers.items():
        attn = block.attention
        if hasattr(attn, "recurrent_state_shapes"):
            raise NotImplementedError(
                f"{family}: layers.{name} is a linear-attention (recurrent) layer; lockstep's vLLM model only wires "
                f"vLLM's paged attention, not its recurrent-state cache: generate hybrid models with --engine lockstep")
        if getattr(attn, "sinks", None) is not None:
            raise NotImplementedError(f"{family}: layers.{name} has attention sinks (GPT-OSS), which lockstep's vLLM "
                                      f"model does not pass to vLLM's kernel: use --engine lockstep")
    layouts = layer_layouts(model)
    for name, lay in layouts.items():
        if lay.window:
            raise NotImplementedError(f"{family}: layers.{name} has a sliding window, which lockstep's vLLM model "
                                      f"does not pass to vLLM's kernel: use --engine lockstep")
        padded_head_size(max(lay.key_dim, lay.value_dim))
    return layouts


class VllmLayerCache:
    """One lockstep attention layer's view of vLLM's cache: what ``LayerCache`` is to lockstep's engine."""

    def __init__(self, attn: nn.Module, layout: LayerLayout, true_scale: float) -> None:
        self.attn, self.layout, self.true_scale = attn, layout, true_scale
        self.size = attn.head_size

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, heads, d]`` -> ``[N, heads * size]`` (zero columns up to the kernel's head size)."""
        if x.shape[-1] != self.size:
            x = torch.nn.functional.pad(x, (0, self.size - x.shape[-1]))
        return x.reshape(x.shape[0], -1)

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, value_dim: int,
             scale: float | None) -> torch.Tensor:
        """q [N, H, d], k/v [N, Hkv, d] -> [1, H, N, value_dim] through vLLM's Attention layer."""
        if scale is not None and not math.isclose(scale, self.true_scale, rel_tol=1e-6):
            raise ValueError(f"attention scale {scale} differs from the {self.true_scale} the vLLM layer was "
                             f"built with")
        n, h = q.shape[0], q.shape[1]
        out = self.attn(self._pad(q), self._pad(k), self._pad(v))  # [N, H * size]
        return out.view(n, h, self.size)[..., :value_dim].transpose(0, 1).unsqueeze(0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str,
               scale: float | None = None, **sink_window: Any) -> torch.Tensor:
        """q [1, H, N, D], new k/v [1, Hkv, N, D] -> [1, H, N, D] (lockstep's ``LayerCache.attend``).
        ``backend`` is the lockstep kernel the layer would run; vLLM's kernel runs instead."""
        if sink_window:
            raise NotImplementedError(f"vLLM attention: {sorted(sink_window)} are not wired")
        return self._run(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), v.shape[-1], scale)

    def attend_latent(self, q: torch.Tensor, latent: torch.Tensor, *, value_dim: int, backend: str,
                      scale: float | None = None) -> torch.Tensor:
        """q [1, H, N, W], new latent [1, N, W] -> [1, H, N, value_dim]: one shared key/value head."""
        kv = latent[0].unsqueeze(1)  # [N, 1, W]
        return self._run(q[0].transpose(0, 1), kv, kv, value_dim, scale)


class VllmStepCache:
    """What the trunk is handed inside vLLM: ``layer(name)`` -> that layer's :class:`VllmLayerCache`."""

    def __init__(self, layers: dict[str, VllmLayerCache]) -> None:
        self._layers = layers

    def layer(self, name: str) -> VllmLayerCache:
        return self._layers[name]


def _true_scale(model: Transformer, name: str, layout: LayerLayout) -> float:
    attn = model.layers[name].attention
    if layout.kind == "latent":
        return float(attn.scale)
    return 1.0 / math.sqrt(layout.key_dim)


class LockstepForCausalLM(nn.Module):
    """vLLM's view of a lockstep ``Transformer`` (module docstring)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        hf_config = vllm_config.model_config.hf_config
        lockstep_config = getattr(hf_config, CONFIG_KEY, None)
        if lockstep_config is None:
            raise ValueError(f"config.json has no {CONFIG_KEY!r} entry: not written by lockstep.vllm.model_dir")
        config: TransformerConfig = config_from_dict(dict(lockstep_config))
        #: lockstep's model, on the device vLLM builds its model on (its default device while it builds);
        #: its weights are loaded afterwards (load_weights). Built in fp32 (vLLM sets the
        #: default dtype to the model's), then the parameters cast: the RoPE tables stay fp32, as lockstep.load
        #: builds them
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            self.model = build_model(config, device=torch.get_default_device(), seed=0).eval()
        finally:
            torch.set_default_dtype(default)
        for param in self.model.parameters():
            param.data = param.data.to(vllm_config.model_config.dtype)
        layouts = check_supported(self.model)
        self.vllm_attention = nn.ModuleDict()
        caches: dict[str, VllmLayerCache] = {}
        for name, lay in layouts.items():
            n_heads = self.model.layers[name].attention.n_heads
            size = padded_head_size(max(lay.key_dim, lay.value_dim))
            scale = _true_scale(self.model, name, lay)
            attn = Attention(n_heads, size, scale, num_kv_heads=lay.heads, cache_config=vllm_config.cache_config,
                             prefix=f"{prefix}model.layers.{name}.attn")
            self.vllm_attention[name] = attn
            caches[name] = VllmLayerCache(attn, lay, scale)
        self._cache = VllmStepCache(caches)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """vLLM's flat batch ``input_ids [N]`` at ``positions [N]`` -> final-normed hidden states [N, dim]."""
        if input_ids is None:
            raise NotImplementedError("lockstep's vLLM model takes token ids, not input embeddings")
        hidden = self.model.trunk(input_ids[None], positions[None], cache=self._cache)[2]
        return hidden[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.output(hidden_states)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy lockstep-named tensors (``model.state_dict()`` names) into the model in place; the names
        loaded. An unknown name or a shape that differs is an error naming it."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(self.model.named_buffers())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = params.get(name)
            if target is None:
                target = buffers.get(name)
            if target is None:
                raise KeyError(f"vLLM lockstep model: no parameter {name!r}")
            if target.shape != tensor.shape:
                raise ValueError(f"vLLM lockstep model: {name} has shape {tuple(target.shape)}, "
                                 f"the weights give {tuple(tensor.shape)}")
            target.copy_(tensor)
            loaded.add(name)
        return loaded
