"""The one way lockstep loads a model: ``load_model(source)`` -> model, tokenizer, and what they are.

``lockstep generate`` / ``chat`` (``--checkpoint``), a trainer's ``init_from`` and the RL policy's
``init_from`` all come here. ``source`` is resolved once (:func:`resolve_source`), in this order:

1. a pretrained name in :data:`PRETRAINED` (``smollm2``: downloaded and converted once into the
   cache, see :mod:`lockstep.models.hf.gguf`);
2. a llama ``.gguf`` file: converted once into an HF directory in the cache;
3. a Hugging Face model directory (``config.json`` + safetensors): ``load_hf``; the tokenizer is
   its ``tokenizer.json`` (eos/bos from ``tokenizer_config.json``), the chat template its own, and
   ``generation_config.json``'s ``eos_token_id`` (an id or a list) adds stop ids;
4. a lockstep model directory (``lockstep_model.json``, as ``lockstep convert --from-hf`` writes):
   ``load_lockstep_dir``, tokenizer files beside it;
5. a training run directory (``manifest.json`` and/or checkpoints under ``checkpoints/`` or the
   run's ``checkpoint.storage``), or that checkpoint directory itself: the latest complete
   checkpoint (or ``step``) is read with ``read_full_state``, the model is built from the config
   recorded in the checkpoint's metadata and loaded from its ``model/<fqn>`` tensors. A run with no
   checkpoint falls back to its ``model.safetensors``. The tokenizer is the one the run's data
   config names (``data.tokenizer_path``, else the trained BPE in the data cache), else the copy in
   the run directory; the chat template is looked up beside it.

With ``config`` (a run's ``model`` config) the checkpoint's config must compute the same function
(:func:`~lockstep.models.hf.config_io.check_same_architecture`: only the flavor name, init_std,
attention backend and ``max_seq_len`` may differ) and the model is built from ``config``.
Anything else is a :class:`ConfigError` naming the field (``field``: ``--checkpoint``,
``init_from``) or the file.

Every weights file is verified against the checksums lockstep writes into it (checkpoints against
their index); a damaged file is one :class:`~lockstep.models.hf.verified.WeightsError` naming it.
Files without checksums (third-party HF directories) load only with ``allow_unverified=True``
(``--allow-unverified-weights``; docs/generation.md, "Verified weights").
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.checkpointer import latest_step
from lockstep.checkpoint.format import INDEX, LATEST, CheckpointError, parse_step_dir
from lockstep.checkpoint.reader import read_full_state
from lockstep.checkpoint.storage import storage_from_uri
from lockstep.config.base import ConfigError
from lockstep.data.config import DataConfig
from lockstep.data.tokenizer import Tokenizer
from lockstep.generate.chat import ChatTemplate, load_chat_template
from lockstep.models.common.transformer import Transformer, TransformerConfig, build_meta_model
from lockstep.models.hf.config_io import check_same_architecture, config_from_dict
from lockstep.models.hf.gguf import gguf_hf_dir, smollm2_hf_dir
from lockstep.models.hf.io import (
    CONFIG_NAME,
    LOCKSTEP_CONFIG_NAME,
    load_hf,
    load_hf_config,
    load_lockstep_dir,
    materialize,
    resolve_dtype,
)

MODEL_PREFIX = "model/"
PathLike = str | os.PathLike[str]

#: pretrained names ``source`` may be -> function(cache_dir) returning an HF directory (made once)
PRETRAINED: dict[str, Callable[[PathLike | None], Path]] = {
    "smollm2": smollm2_hf_dir,
    "smollm2-135m-instruct": smollm2_hf_dir,
}


@dataclasses.dataclass
class LoadedModel:
    """A model with the text side that belongs to it."""

    model: Transformer
    #: None when loaded with ``tokenizer=False``
    tokenizer: Tokenizer | None
    #: the tokenizer's chat template, None when it has none
    chat_template: ChatTemplate | None
    #: end-of-turn ids beyond the tokenizer's eos (from generation_config.json)
    stop_token_ids: list[int]
    #: "hf", "lockstep", "checkpoint" or "run-weights"
    kind: str
    #: one line for the user: what was loaded from where
    description: str
    #: the directory ``source`` resolved to
    path: Path


def resolve_source(source: PathLike, field: str = "--checkpoint", cache_dir: PathLike | None = None) -> Path:
    """The directory ``source`` names: a pretrained name or a .gguf file (converted once into the
    cache), else the directory itself."""
    key = str(source)
    if key in PRETRAINED:
        return PRETRAINED[key](cache_dir)
    path = Path(key).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_hf_dir(path, cache_dir)
    if not path.exists():
        raise ConfigError(f"{field} {path}: no such directory (nor a pretrained name: {sorted(PRETRAINED)})")
    if not path.is_dir():
        raise ConfigError(f"{field} {path}: not a directory (expected a model or run directory, or a .gguf file)")
    return path


def load_model(source: PathLike, *, config: TransformerConfig | None = None, step: int | None = None,
               dtype: torch.dtype | str | None = torch.float32, device: torch.device | str = "cpu",
               tokenizer: bool = True, field: str = "--checkpoint",
               cache_dir: PathLike | None = None, allow_unverified: bool = False) -> LoadedModel:
    """Load ``source`` (see the module docstring). ``step`` picks a checkpoint of a run directory;
    ``dtype`` None or "auto" keeps the stored dtype; ``tokenizer=False`` skips the text side;
    ``allow_unverified`` also loads weight files that carry no checksums (with a warning)."""
    path = resolve_source(source, field, cache_dir)
    model_dir = (path / CONFIG_NAME).is_file() or (path / LOCKSTEP_CONFIG_NAME).is_file()
    if step is not None and model_dir:
        raise ConfigError(f"--step: {path} is a model directory, not a training run; --step picks a run's checkpoint")
    if (path / CONFIG_NAME).is_file():
        if config is not None:  # before reading any weights; the message names the field and the file
            check_same_architecture(load_hf_config(path), config, f"{field} {path / CONFIG_NAME}")
        loaded = _load_hf_dir(path, config, dtype, device, tokenizer, field, allow_unverified)
    elif (path / LOCKSTEP_CONFIG_NAME).is_file():
        loaded = _load_lockstep_model_dir(path, dtype, device, tokenizer, field, allow_unverified)
    else:
        storage_root, manifest = _checkpoint_location(path)
        if storage_root is None and manifest is None:
            held = sorted(p.name for p in path.iterdir())
            listing = ", ".join(held[:6]) + (", ..." if len(held) > 6 else "") if held else "nothing"
            raise ConfigError(
                f"{field} {path}: not a model directory: expected a Hugging Face model directory (config.json), a "
                f"lockstep model directory (lockstep_model.json) or a training run directory (manifest.json, "
                f"checkpoints/); it holds {listing}")
        loaded = _load_run(path, storage_root, manifest, step, dtype, device, tokenizer, field, allow_unverified)
    if config is not None and loaded.kind != "hf":  # load_hf built the model from ``config``
        check_same_architecture(loaded.model.config, config, f"{field} {path}")
        if config != loaded.model.config:
            loaded.model = materialize(build_meta_model(config), loaded.model.state_dict(), device)
    return loaded


# -- model directories ---------------------------------------------------------------------------


def _load_hf_dir(path: Path, config: TransformerConfig | None, dtype: Any, device: Any, text: bool,
                 field: str, allow_unverified: bool) -> LoadedModel:
    model = load_hf(path, device=device, dtype=dtype, config=config, allow_unverified=allow_unverified)
    description = f"{path} (Hugging Face {model.config.family}, {model.num_params():,} parameters)"
    if not text:
        return LoadedModel(model, None, None, [], "hf", description, path)
    tokenizer = _tokenizer(path / "tokenizer.json", f"{path} holds no tokenizer.json (a Hugging Face model "
                           "directory needs its tokenizer to generate text)", field)
    return LoadedModel(model, tokenizer, load_chat_template(path), _generation_stop_ids(path), "hf", description,
                       path)


def _load_lockstep_model_dir(path: Path, dtype: Any, device: Any, text: bool, field: str,
                             allow_unverified: bool) -> LoadedModel:
    model = load_lockstep_dir(path, device=device, dtype=dtype, allow_unverified=allow_unverified)
    description = f"{path} (lockstep {model.config.family}, {model.num_params():,} parameters)"
    if not text:
        return LoadedModel(model, None, None, [], "lockstep", description, path)
    tokenizer = _tokenizer(path / "tokenizer.json", f"{path} holds no tokenizer.json (`lockstep convert` copies "
                           "it from the source directory; put the model's tokenizer.json there)", field)
    return LoadedModel(model, tokenizer, load_chat_template(path), _generation_stop_ids(path), "lockstep",
                       description, path)


def _generation_stop_ids(path: Path) -> list[int]:
    file = path / "generation_config.json"
    if not file.is_file():
        return []
    try:
        value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        raise ConfigError(f"{file}: not a valid JSON object") from None
    ids = value if isinstance(value, list) else [value]
    return [int(i) for i in ids if isinstance(i, int) and i >= 0]


def _tokenizer(file: Path, missing: str, field: str) -> Tokenizer:
    if not file.is_file():
        raise ConfigError(f"{field}: {missing}")
    try:
        return Tokenizer.from_file(file)
    except Exception as err:  # tokenizers raises its own Exception type for unreadable files
        raise ConfigError(f"{file}: cannot load the tokenizer: {str(err).splitlines()[0]}") from None


# -- training runs -------------------------------------------------------------------------------


def _read_manifest(path: Path) -> dict[str, Any] | None:
    file = path / "manifest.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{file}: not valid JSON ({err})") from None
    return data if isinstance(data, dict) else None


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / LATEST).is_file() or any(parse_step_dir(p.name) is not None and (p / INDEX).is_file()
                                            for p in path.iterdir() if p.is_dir())


def _checkpoint_location(path: Path) -> tuple[str | None, dict[str, Any] | None]:
    """(checkpoint storage URI or None, the run's manifest or None) of a run or checkpoint directory."""
    manifest = _read_manifest(path)
    recipe = (manifest or {}).get("recipe")
    ckpt = recipe.get("checkpoint") if isinstance(recipe, dict) else None
    configured = ckpt.get("storage") if isinstance(ckpt, dict) else ""
    if configured:
        return configured, manifest
    if (path / "checkpoints").is_dir() and _is_checkpoint_dir(path / "checkpoints"):
        return str(path / "checkpoints"), manifest
    if _is_checkpoint_dir(path):
        return str(path), manifest
    return None, manifest


def _load_run(path: Path, storage_uri: str | None, manifest: dict[str, Any] | None, step: int | None,
              dtype: Any, device: Any, text: bool, field: str, allow_unverified: bool) -> LoadedModel:
    storage = None
    if storage_uri is not None:
        recipe = (manifest or {}).get("recipe") or {}
        endpoint = (recipe.get("checkpoint") or {}).get("endpoint_url", "") if isinstance(recipe, dict) else ""
        try:
            storage = storage_from_uri(storage_uri, endpoint_url=endpoint or "")
        except ValueError as err:
            raise ConfigError(f"{path / 'manifest.json'}: {err}") from None
    if storage is not None and (step is not None or latest_step(storage) is not None):
        return _load_checkpoint(path, storage, step, dtype, device, text, field)
    if step is not None:
        raise ConfigError(f"--step {step}: {path} has no checkpoints")
    if manifest is not None and (path / "model.safetensors").is_file():
        model = load_lockstep_dir(path, device=device, dtype=dtype, allow_unverified=allow_unverified)
        recipe = manifest.get("recipe") or {}
        tokenizer, template = _run_tokenizer(path, recipe.get("data"), field) if text else (None, None)
        return LoadedModel(model, tokenizer, template, [], "run-weights",
                           f"{path}/model.safetensors (run of recipe {recipe.get('recipe')!r}, "
                           f"{model.config.family}, {model.num_params():,} parameters)", path)
    where = storage.describe() if storage is not None else f"{path}/checkpoints"
    raise ConfigError(f"{field} {path}: a training run without weights: no complete checkpoint in {where} "
                      f"and no model.safetensors (did the run save any?)")


def _load_checkpoint(path: Path, storage: Any, step: int | None, dtype: Any, device: Any, text: bool,
                     field: str) -> LoadedModel:
    try:
        step, tensors, meta = read_full_state(storage, step)
    except CheckpointError as err:
        raise ConfigError(" ".join(str(err).split())) from None
    where = f"{storage.describe()} step {step}"
    config_dict = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(config_dict, dict) or not isinstance(config_dict.get("model"), dict):
        raise ConfigError(f"{where}: the checkpoint's index records no run config (metadata.config.model)")
    try:
        config = config_from_dict(config_dict["model"])
        config.validate()
    except ConfigError as err:
        raise ConfigError(f"{where}: recorded model config: {err}") from None
    state = {name[len(MODEL_PREFIX):]: t for name, t in tensors.items() if name.startswith(MODEL_PREFIX)}
    if config.tie_embeddings:  # stored once, under the embedding
        shared = state.get("tok_embeddings.weight", state.get("output.weight"))
        if shared is not None:
            state["tok_embeddings.weight"] = state["output.weight"] = shared
    dtype = resolve_dtype(dtype)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).to(device)
             for k, v in state.items()}
    model = build_meta_model(config)
    expected, found = set(model.state_dict()), set(state)
    if expected != found:
        missing, extra = sorted(expected - found), sorted(found - expected)
        raise ConfigError(f"{where}: the model/ tensors do not fit the recorded {config.family} config: "
                          f"missing {missing[:8]}, unexpected {extra[:8]}")
    model = materialize(model, state, device)
    tokenizer, template = _run_tokenizer(path, config_dict.get("data"), field) if text else (None, None)
    return LoadedModel(model, tokenizer, template, [], "checkpoint",
                       f"{where} (run of recipe {config_dict.get('recipe')!r}, {config.family}, "
                       f"{model.num_params():,} parameters)", path)


def _run_tokenizer(path: Path, data: Any, field: str) -> tuple[Tokenizer, ChatTemplate | None]:
    """The tokenizer the run's data config used (else the run's copy) and its chat template."""
    candidates = []
    if isinstance(data, dict):
        try:
            candidates.append(config_from_dict(data, DataConfig, "data").resolved_tokenizer_path())
        except ConfigError:
            pass  # an older or foreign data config: fall back to the run's copy
    candidates.append(path / "tokenizer.json")
    for file in candidates:
        if file.is_file():
            template = load_chat_template(file.parent) if file.parent != path else None
            return _tokenizer(file, "", field), template or load_chat_template(path)
    raise ConfigError(f"{field} {path}: the run's tokenizer is not found (looked for "
                      f"{', '.join(str(c) for c in candidates)}; data.tokenizer_path names it)")
