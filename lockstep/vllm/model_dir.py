"""The directory vLLM is pointed at for a lockstep model: a ``config.json`` and nothing else.

vLLM reads the architecture and the sizes it plans memory with from ``config.json``;
``architectures: ["LockstepForCausalLM"]`` selects :class:`lockstep.vllm.model.LockstepForCausalLM`,
which builds the model from the full lockstep config stored under ``lockstep_model``. No weights
are written: vLLM starts with placeholder weights (``load_format="dummy"``) and the engine copies
the lockstep model's tensors in (:meth:`lockstep.vllm.engine.VllmEngine.load_weights`), the same
in-place path every later weight update takes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lockstep.models.common.transformer import TransformerConfig
from lockstep.models.hf.config_io import config_to_dict
from lockstep.vllm.model import CONFIG_KEY

from lockstep.vllm import ARCHITECTURE


def hf_config_dict(config: TransformerConfig, dtype: torch.dtype) -> dict:
    """``config.json`` for vLLM: Llama-shaped size fields (what vLLM's planning reads) + the lockstep config."""
    return {
        "architectures": [ARCHITECTURE],
        # a model type transformers knows, so vLLM's AutoConfig reads the file; the architecture decides the model
        "model_type": "llama",
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.resolved_head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        # the lockstep model ties its own head; vLLM must not tie anything of its own
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        CONFIG_KEY: config_to_dict(config),
    }


def write_model_dir(config: TransformerConfig, dtype: torch.dtype, path: str | Path) -> Path:
    """Write the ``config.json`` of ``config`` into ``path`` (created); returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_dict(config, dtype), indent=1))
    return path
