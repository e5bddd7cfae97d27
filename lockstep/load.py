"""What a ``--checkpoint DIR`` names, loaded for generation: model, tokenizer, chat template, stop ids.

``load_model_source(DIR)`` accepts, in this order:

1. a Hugging Face model directory (``config.json`` + safetensors): ``load_hf``; the tokenizer is
   its ``tokenizer.json`` (eos/bos from ``tokenizer_config.json``), the chat template its own, and
   ``generation_config.json``'s ``eos_token_id`` (an id or a list) adds stop ids;
2. a lockstep model directory (``lockstep_model.json``, as ``lockstep convert --from-hf`` writes):
   ``load_lockstep_dir``, tokenizer files beside it;
3. a training run directory (``manifest.json`` and/or checkpoints under ``checkpoints/`` or the
   run's ``checkpoint.storage``), or that checkpoint directory itself: the latest complete
   checkpoint (or ``step``) is read with ``read_full_state``, the model is built from the recipe
   recorded in the checkpoint's metadata and loaded from its ``model/<fqn>`` tensors. A run with no
   checkpoint falls back to its ``model.safetensors``. The tokenizer is the one the run's data
   config names (``data.tokenizer_path``, else the trained BPE in the data cache), else the copy in
   the run directory; the chat template is looked up beside it.

Anything else is a :class:`ConfigError` naming the path and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.format import INDEX, LATEST, CheckpointError, parse_step_dir
from lockstep.config.base import ConfigError
from lockstep.data.tokenizer import Tokenizer
from lockstep.generate.chat import ChatTemplate, load_chat_template
from lockstep.models.common.transformer import Transformer

#: the flag whose value this module resolves (named in every error)
FLAG = "--checkpoint"
MODEL_PREFIX = "model/"


@dataclasses.dataclass
class ModelSource:
    """A model ready for the generation engine, with the text side that belongs to it."""

    model: Transformer
    tokenizer: Tokenizer
    #: the tokenizer's chat template, None when it has none
    chat_template: ChatTemplate | None
    #: end-of-turn ids beyond the tokenizer's eos (from generation_config.json)
    stop_token_ids: list[int]
    #: "hf", "lockstep", "checkpoint" or "run-weights"
    kind: str
    #: one line for the user: what was loaded from where
    description: str


def load_model_source(path: str | Path, *, step: int | None = None,
                      dtype: torch.dtype | str | None = torch.float32) -> ModelSource:
    """Load ``path`` (see the module docstring); ``step`` picks a checkpoint of a run directory."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"{FLAG} {path}: no such directory")
    if not path.is_dir():
        raise ConfigError(f"{FLAG} {path}: not a directory (expected a model or run directory)")
    if step is not None and ((path / "config.json").is_file() or (path / "lockstep_model.json").is_file()):
        raise ConfigError(f"--step: {path} is a model directory, not a training run; --step picks a run's checkpoint")
    if (path / "config.json").is_file():
        return _load_hf_dir(path, dtype)
    if (path / "lockstep_model.json").is_file():
        return _load_lockstep_model_dir(path, dtype)
    storage_root, manifest = _checkpoint_location(path)
    if storage_root is not None or manifest is not None:
        return _load_run(path, storage_root, manifest, step, dtype)
    held = sorted(p.name for p in path.iterdir())
    raise ConfigError(
        f"{FLAG} {path}: not a model directory: expected a Hugging Face model directory (config.json), a lockstep "
        f"model directory (lockstep_model.json) or a training run directory (manifest.json, checkpoints/); it holds "
        f"{', '.join(held[:6]) + (', ...' if len(held) > 6 else '') if held else 'nothing'}")


# -- model directories ---------------------------------------------------------------------------


def _load_hf_dir(path: Path, dtype: Any) -> ModelSource:
    from lockstep.models.hf import load_hf

    model = load_hf(path, dtype=dtype).eval()
    tokenizer = _tokenizer(path / "tokenizer.json", f"{path} holds no tokenizer.json (a Hugging Face model "
                           "directory needs its tokenizer to generate text)")
    cfg = model.config
    return ModelSource(model, tokenizer, load_chat_template(path), _generation_stop_ids(path), "hf",
                       f"{path} (Hugging Face {cfg.family}, {model.num_params():,} parameters)")


def _load_lockstep_model_dir(path: Path, dtype: Any) -> ModelSource:
    from lockstep.models.hf import load_lockstep_dir

    model = load_lockstep_dir(path, dtype=dtype).eval()
    tokenizer = _tokenizer(path / "tokenizer.json", f"{path} holds no tokenizer.json (`lockstep convert` copies "
                           "it from the source directory; put the model's tokenizer.json there)")
    return ModelSource(model, tokenizer, load_chat_template(path), _generation_stop_ids(path), "lockstep",
                       f"{path} (lockstep {model.config.family}, {model.num_params():,} parameters)")


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


def _tokenizer(file: Path, missing: str) -> Tokenizer:
    if not file.is_file():
        raise ConfigError(f"{FLAG}: {missing}")
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
              dtype: Any) -> ModelSource:
    from lockstep.checkpoint.checkpointer import latest_step
    from lockstep.checkpoint.storage import storage_from_uri

    storage = None
    if storage_uri is not None:
        recipe = (manifest or {}).get("recipe") or {}
        endpoint = (recipe.get("checkpoint") or {}).get("endpoint_url", "") if isinstance(recipe, dict) else ""
        try:
            storage = storage_from_uri(storage_uri, endpoint_url=endpoint or "")
        except ValueError as err:
            raise ConfigError(f"{path / 'manifest.json'}: {err}") from None
    if storage is not None and (step is not None or latest_step(storage) is not None):
        return _load_checkpoint(path, storage, step, dtype)
    if step is not None:
        raise ConfigError(f"--step {step}: {path} has no checkpoints")
    if manifest is not None and (path / "model.safetensors").is_file():
        from lockstep.models.hf import load_lockstep_dir

        model = load_lockstep_dir(path, dtype=dtype).eval()
        tokenizer, template = _run_tokenizer(path, (manifest.get("recipe") or {}).get("data"))
        return ModelSource(model, tokenizer, template, [], "run-weights",
                           f"{path}/model.safetensors (run of recipe {(manifest.get('recipe') or {}).get('recipe')!r}, "
                           f"{model.config.family}, {model.num_params():,} parameters)")
    where = storage.describe() if storage is not None else f"{path}/checkpoints"
    raise ConfigError(f"{FLAG} {path}: a training run without weights: no complete checkpoint in {where} "
                      f"and no model.safetensors (did the run save any?)")


def _load_checkpoint(path: Path, storage: Any, step: int | None, dtype: Any) -> ModelSource:
    from lockstep.checkpoint.reader import read_full_state
    from lockstep.models.hf.config_io import config_from_dict
    from lockstep.models.hf.io import _materialize, _meta_model, _resolve_dtype

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
    dtype = _resolve_dtype(dtype)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    model = _meta_model(config)
    expected, found = set(model.state_dict()), set(state)
    if expected != found:
        missing, extra = sorted(expected - found), sorted(found - expected)
        raise ConfigError(f"{where}: the model/ tensors do not fit the recorded {config.family} config: "
                          f"missing {missing[:8]}, unexpected {extra[:8]}")
    model = _materialize(model, state, "cpu").eval()
    tokenizer, template = _run_tokenizer(path, config_dict.get("data"))
    return ModelSource(model, tokenizer, template, [], "checkpoint",
                       f"{where} (run of recipe {config_dict.get('recipe')!r}, {config.family}, "
                       f"{model.num_params():,} parameters)")


def _run_tokenizer(path: Path, data: Any) -> tuple[Tokenizer, ChatTemplate | None]:
    """The tokenizer the run's data config used (else the run's copy) and its chat template."""
    from lockstep.data.config import DataConfig
    from lockstep.models.hf.config_io import config_from_dict

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
            return _tokenizer(file, ""), template or load_chat_template(path)
    raise ConfigError(f"{FLAG} {path}: the run's tokenizer is not found (looked for "
                      f"{', '.join(str(c) for c in candidates)}; data.tokenizer_path names it)")
