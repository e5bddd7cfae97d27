"""Read and write Hugging Face model directories and lockstep model directories.

A Hugging Face directory holds ``config.json`` and either ``model.safetensors`` or shards listed
by ``model.safetensors.index.json``. ``load_hf`` picks the family from ``model_type``, converts
config and tensors through the family's adapter and loads them strictly; ``save_hf`` writes a
directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

A lockstep directory holds ``model.safetensors`` under lockstep's own parameter names plus
``lockstep_model.json`` (the ``TransformerConfig`` as ``to_dict`` writes it). A training run
directory (``manifest.json`` + ``model.safetensors``) reads the same way.

Problems raise :class:`ConfigError` naming the file and every offending tensor. Every weights file
is written and read through :mod:`lockstep.models.hf.verified`: checksummed on write, verified on
read (a damaged file is a :class:`~lockstep.models.hf.verified.WeightsError`); files without
checksums load only with ``allow_unverified=True``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import Transformer, TransformerConfig, build_meta_model
from lockstep.models.hf.config_io import check_same_architecture, config_from_dict, config_to_dict
from lockstep.models.hf.dense import IGNORED_HF_TENSORS
from lockstep.models.hf.verified import WeightsError, WeightsHeader, read_header, read_tensors, require_checksums, \
    write_weights
from lockstep.models.registry import get_model_spec, spec_for_hf_model_type

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
LOCKSTEP_CONFIG_NAME = "lockstep_model.json"
MANIFEST_NAME = "manifest.json"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_LIST_LIMIT = 20

PathLike = str | os.PathLike[str]


# -- helpers -------------------------------------------------------------------------------------


def _names(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_LIST_LIMIT])
    return f"[{shown}{f', ... ({len(names) - _LIST_LIMIT} more)' if len(names) > _LIST_LIMIT else ''}]"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except ValueError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a torch dtype; None (and "auto") mean "as stored"."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ConfigError(f"dtype {dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
    return resolved


def _adapter_for(spec: Any, where: str) -> Any:
    if spec.hf_adapter is None:
        raise ConfigError(f"{where}: family {spec.name!r} has no Hugging Face adapter")
    return spec.hf_adapter


def _check_tensors(
    where: str,
    found: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    ignore: Any = None,
    optional: Iterable[str] = (),
) -> None:
    """One ConfigError listing missing, unexpected and mis-shaped tensors (if any)."""
    optional = set(optional)
    missing = sorted(set(expected) - set(found) - optional)
    unexpected = sorted(n for n in set(found) - set(expected) - optional if not (ignore and ignore(n)))
    shapes = [f"{n} (expected {list(expected[n])}, got {list(found[n])})"
              for n in sorted(set(found) & set(expected)) if tuple(found[n]) != tuple(expected[n])]
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensor(s) {_names(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch: {'; '.join(shapes[:_LIST_LIMIT])}"
                        + (f"; ... ({len(shapes) - _LIST_LIMIT} more)" if len(shapes) > _LIST_LIMIT else ""))
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))


def _expected_shapes(model: Transformer) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def materialize(model: Transformer, state: dict[str, torch.Tensor], device: torch.device | str) -> Transformer:
    """Load ``state`` into a meta-built model by assignment, then rebuild non-persistent buffers
    (the RoPE tables) on ``device``."""
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    for name, module in model.named_modules():
        meta_buffers = [b for b, t in module.named_buffers(recurse=False) if t is not None and t.is_meta]
        if not meta_buffers:
            continue
        if any(True for _ in module.parameters(recurse=False)) or not hasattr(module, "reset_parameters"):
            raise RuntimeError(f"cannot rebuild buffers {meta_buffers} of module {name!r}")
        for b in meta_buffers:
            module._buffers[b] = torch.empty_like(module._buffers[b], device=device)
        module.reset_parameters()
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise RuntimeError(f"tensors left on the meta device: {leftover}")
    return model


# -- Hugging Face directories ----------------------------------------------------------------------


def read_hf_config(path: PathLike) -> dict[str, Any]:
    """The ``config.json`` dict of an HF model directory (ConfigError if there is none)."""
    path = Path(path)
    file = path / CONFIG_NAME
    if not path.is_dir():
        raise ConfigError(f"{path}: not a directory (expected a Hugging Face model directory)")
    if not file.is_file():
        held = sorted(p.name for p in path.iterdir())
        raise ConfigError(f"{file}: missing; {path} is not a Hugging Face model directory "
                          f"(it holds {len(held)} entries{': ' + ', '.join(held[:5]) if held else ''}"
                          f"{', ...' if len(held) > 5 else ''})")
    return _read_json(file)


def _spec_and_adapter(hf_config: dict[str, Any], file: Path) -> tuple[Any, Any]:
    model_type = hf_config.get("model_type")
    if not model_type:
        raise ConfigError(f"{file}: no model_type field")
    try:
        spec = spec_for_hf_model_type(model_type)
    except ConfigError as err:
        raise ConfigError(f"{file}: {err}") from None
    return spec, _adapter_for(spec, str(file))


def load_hf_config(path: PathLike) -> TransformerConfig:
    """The lockstep config equal in architecture to an HF directory's ``config.json``."""
    hf_config = read_hf_config(path)
    file = Path(path) / CONFIG_NAME
    _, adapter = _spec_and_adapter(hf_config, file)
    try:
        config = adapter.config_from_hf(hf_config)
        config.validate()
    except ConfigError as err:
        raise ConfigError(f"{file}: {err}") from None
    return config


INDEX_CHECKSUMS = "lockstep_data_sha256"  # index.json metadata: shard file -> its data sha256


def hf_weight_files(path: PathLike) -> dict[str, WeightsHeader]:
    """HF tensor name -> the checked header of the safetensors file holding it (single file or
    sharded with index)."""
    path = Path(path)
    index = path / INDEX_NAME
    single = path / WEIGHTS_NAME
    if single.is_file():
        header = read_header(single)
        return {name: header for name in header.entries}
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index}: no weight_map object")
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not (path / s).is_file()]
        if absent:
            raise ConfigError(f"{index}: shard file(s) {absent} missing from {path}")
        listed = (data.get("metadata") or {}).get(INDEX_CHECKSUMS) or {}
        # Trust the shards' own tables, not just the index, so a stale index is caught.
        out: dict[str, WeightsHeader] = {}
        for shard in shards:
            header = read_header(path / shard)
            if shard in listed and header.checksum != listed[shard]:
                raise WeightsError(f"{path / shard}: its checksum differs from the one {index.name} records for it "
                                   "(a shard of another export, or a damaged header)")
            out.update({name: header for name in header.entries})
        not_in_shards = sorted(set(weight_map) - set(out))
        if not_in_shards:
            raise ConfigError(f"{index}: lists tensor(s) absent from its shards: {_names(not_in_shards)}")
        return out
    found = sorted(p.name for p in path.glob("*.safetensors")) + sorted(p.name for p in path.glob("*.bin"))
    raise ConfigError(f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME} (found {found or 'no weight files'}; "
                      f"only safetensors checkpoints are read)")


def _shapes_of(files: dict[str, WeightsHeader]) -> dict[str, tuple[int, ...]]:
    return {name: header.entries[name].shape for name, header in files.items()}


def _read_tensors(files: dict[str, WeightsHeader], names: Iterable[str], device: torch.device | str,
                  dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The tensors ``names``, each file read once (and verified as it is read)."""
    wanted = set(names)
    by_file: dict[Path, tuple[WeightsHeader, list[str]]] = {}
    for name, header in files.items():
        listed = by_file.setdefault(header.path, (header, []))[1]
        if name in wanted:
            listed.append(name)
    out: dict[str, torch.Tensor] = {}
    for header, file_names in by_file.values():
        out.update(read_tensors(header, file_names, dtype=dtype, device=device))
    return out


def _headers(files: dict[str, WeightsHeader]) -> list[WeightsHeader]:
    return list({h.path: h for h in files.values()}.values())


def load_hf(
    path: PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    config: TransformerConfig | None = None,
    *,
    allow_unverified: bool = False,
) -> Transformer:
    """A lockstep ``Transformer`` holding the weights of the HF model directory ``path``.

    ``dtype`` None (or "auto") keeps the dtype stored in the files; pass ``torch.float32`` for
    fp32 master weights. ``config`` may replace the one read from config.json to change what
    does not alter the function (attention backend, overrides of it, ``max_seq_len``, flavor);
    any other difference is a ConfigError naming the field. Every file is verified against its
    checksums; ``allow_unverified`` also loads files that carry none (third-party directories).
    """
    path = Path(path)
    dtype = resolve_dtype(dtype)
    hf_config = read_hf_config(path)
    spec, adapter = _spec_and_adapter(hf_config, path / CONFIG_NAME)
    stored = load_hf_config(path)
    if config is None:
        config = stored
    else:
        check_same_architecture(stored, config, str(path / CONFIG_NAME))
    model = build_meta_model(config)
    expected_ls = _expected_shapes(model)
    expected_hf, tied_optional = _expected_hf_shapes(adapter, model, config)
    if hasattr(adapter, "stored_hf_shapes"):  # a stored format other than state_to_hf's (GPT-OSS MXFP4 experts)
        expected_hf = adapter.stored_hf_shapes(expected_hf, hf_config)
    files = hf_weight_files(path)
    where = f"{path / (WEIGHTS_NAME if (path / WEIGHTS_NAME).is_file() else INDEX_NAME)} ({spec.name})"
    _check_tensors(where, _shapes_of(files), expected_hf, ignore=IGNORED_HF_TENSORS.search, optional=tied_optional)
    require_checksums(_headers(files), allow_unverified, f"the model in {path}")
    keep = [n for n in files if n in expected_hf or n in tied_optional]
    hf_state = _read_tensors(files, keep, device, dtype)
    try:
        state = adapter.state_from_hf(hf_state, config)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    _check_tensors(f"{where} after conversion", {k: tuple(v.shape) for k, v in state.items()}, expected_ls)
    return materialize(model, state, device)


def _expected_hf_shapes(adapter: Any, model: Transformer, config: TransformerConfig
                        ) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """HF name -> shape of every tensor the HF file must hold (renaming meta tensors through the
    adapter), and the names a tied checkpoint may hold or leave out (the duplicated head)."""
    meta_state = model.state_dict()
    expected = {n: tuple(t.shape) for n, t in adapter.state_to_hf(meta_state, config).items()}
    optional: set[str] = set()
    if config.tie_embeddings:
        untied = dataclasses.replace(config, tie_embeddings=False)
        optional = set(adapter.state_to_hf(meta_state, untied)) - set(expected)
    return expected, optional


def _plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _remove_old_weights(path: Path) -> None:
    for file in path.iterdir():
        if file.name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(file.name):
            file.unlink()


def save_hf(
    model: Transformer,
    path: PathLike,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    config_extra: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
    dtype: torch.dtype | str | None = None,
) -> Path:
    """Write ``model`` as an HF directory (config.json + safetensors, sharded above
    ``max_shard_bytes`` with an index) that transformers' ``from_pretrained`` loads.

    ``config_extra`` is merged into config.json (e.g. ``bos_token_id``/``eos_token_id``);
    ``generation_config`` is written as generation_config.json when given. ``dtype`` casts the
    saved weights (default: as they are). Old weight files in ``path`` are removed first.
    """
    if max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    path = Path(path)
    config = model.config
    spec = get_model_spec(config.family)
    adapter = _adapter_for(spec, f"save_hf({path})")
    hf_config = adapter.config_to_hf(config)
    dtype = resolve_dtype(dtype)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    hf_state = adapter.state_to_hf(state, config)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.to("cpu").contiguous()
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        hf_config["dtype"] = str(next(iter(dtypes))).removeprefix("torch.")
    hf_config.update(config_extra or {})
    path.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(path)
    shards = _plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_weights(shards[0], path / WEIGHTS_NAME)
    else:
        weight_map: dict[str, str] = {}
        checksums: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            checksums[name] = write_weights(shard, path / name)
            weight_map.update({t: name for t in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total, INDEX_CHECKSUMS: checksums},
                 "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    (path / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if generation_config is not None:
        (path / GENERATION_CONFIG_NAME).write_text(json.dumps(generation_config, indent=2) + "\n",
                                                  encoding="utf-8")
    return path


# -- lockstep directories --------------------------------------------------------------------------


def save_lockstep_dir(model: Transformer, path: PathLike) -> Path:
    """Write ``model`` as a lockstep directory: ``model.safetensors`` (lockstep names; a tied head
    is stored once, as ``tok_embeddings.weight``) and ``lockstep_model.json``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("output.weight", None)
    write_weights(state, path / WEIGHTS_NAME)
    (path / LOCKSTEP_CONFIG_NAME).write_text(json.dumps(config_to_dict(model.config), indent=2) + "\n",
                                             encoding="utf-8")
    return path


def load_lockstep_config(path: PathLike) -> TransformerConfig:
    """The TransformerConfig of a lockstep directory (``lockstep_model.json``) or of a training
    run directory (``manifest.json``'s recorded config)."""
    path = Path(path)
    own, manifest = path / LOCKSTEP_CONFIG_NAME, path / MANIFEST_NAME
    if own.is_file():
        data, file = _read_json(own), own
    elif manifest.is_file():
        recipe = _read_json(manifest).get("recipe")
        data, file = (recipe or {}).get("model") if isinstance(recipe, dict) else None, manifest
        if not isinstance(data, dict):
            raise ConfigError(f"{manifest}: no recipe.model config recorded")
    else:
        raise ConfigError(f"{path}: neither {LOCKSTEP_CONFIG_NAME} nor {MANIFEST_NAME} found "
                          f"(not a lockstep model or run directory)")
    try:
        config = config_from_dict(data)
        config.validate()
    except ConfigError as err:
        raise ConfigError(f"{file}: {err}") from None
    return config


def load_lockstep_dir(
    path: PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None, *,
    allow_unverified: bool = False,
) -> Transformer:
    """A ``Transformer`` from a lockstep directory or training run directory, its
    ``model.safetensors`` verified against its checksums (``allow_unverified``: also without any)."""
    path = Path(path)
    config = load_lockstep_config(path)
    dtype = resolve_dtype(dtype)
    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise ConfigError(f"{file}: missing")
    header = read_header(file)
    files = {name: header for name in header.entries}
    model = build_meta_model(config)
    expected = _expected_shapes(model)
    optional = {"output.weight", "tok_embeddings.weight"} if config.tie_embeddings else set()
    found = _shapes_of(files)
    _check_tensors(str(file), found, expected, optional=optional)
    if config.tie_embeddings and not optional & set(found):
        raise ConfigError(f"{file}: missing tensor(s) [tok_embeddings.weight]")
    require_checksums([header], allow_unverified, f"the model in {path}")
    state = _read_tensors(files, list(files), device, dtype)
    if config.tie_embeddings:
        # The trainer's save_model keeps one name of a shared tensor; either may be there.
        shared = state.get("tok_embeddings.weight", state.get("output.weight"))
        state["tok_embeddings.weight"] = state["output.weight"] = shared
    return materialize(model, state, device)
