"""Verified weights (#15): every weights file lockstep writes carries sha256 checksums, every load
verifies them, and a damaged or unverifiable file is ONE error line naming the file, never garbage
output with exit code 0 and never a traceback from inside safetensors."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lockstep.cli import main
from lockstep.load import load_model
from lockstep.models.common.transformer import build_model
from lockstep.models.hf import load_hf, load_lockstep_dir, save_hf, save_lockstep_dir
from lockstep.models.hf.verified import (
    DATA_KEY,
    TABLE_KEY,
    UnverifiedWeightsWarning,
    WeightsError,
    read_header,
    read_tensors,
    write_weights,
)
from lockstep.models.registry import model_config

FLAG = "--allow-unverified-weights"
PROMPT = ["--prompt", "ROMEO:", "--max-new-tokens", "4", "--json"]


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory) -> Path:
    """A 1-step debug run reduced to what generate reads when there is no checkpoint: its manifest,
    the model.safetensors the trainer wrote (save_weights) and its tokenizer."""
    run = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", "--recipe", "debug", "--steps", "1", "--output.sample-tokens", "0",
                 "--run-dir", str(run)]) == 0
    weights = tmp_path_factory.mktemp("weights") / "run"
    weights.mkdir()
    for name in ("manifest.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(run / name, weights / name)
    return weights


@pytest.fixture
def run_dir(pristine_run, tmp_path) -> Path:
    return Path(shutil.copytree(pristine_run, tmp_path / "run"))


def _data_start(file: Path) -> int:
    return 8 + struct.unpack("<Q", file.read_bytes()[:8])[0]


def _flip_bit(file: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 1 << bit
    file.write_bytes(bytes(data))


def _flip_data_bit(file: Path) -> None:
    """One bit of one weight, in the middle of the data region (an exponent bit: a huge or NaN value)."""
    start = _data_start(file)
    middle = start + (file.stat().st_size - start) // 2
    _flip_bit(file, middle - middle % 4 + 3, 6)


def _generate_fails(capsys, run_dir: Path, *extra: str) -> str:
    """``lockstep generate --json`` on ``run_dir``: a non-zero exit, no JSON, and one stderr line (returned)."""
    rc = main(["generate", "--checkpoint", str(run_dir), *PROMPT, *extra])
    out, err = capsys.readouterr()
    assert rc != 0 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    return err


def _small_model(family: str = "llama3", **changes) -> torch.nn.Module:
    return build_model(dataclasses.replace(model_config(family, "debug"), **changes), seed=0)


def _equal_states(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- run weights -------------------------------------------------------------------------------


def test_run_weights_carry_checksums_and_generate_verifies_them(run_dir, capsys):
    header = read_header(run_dir / "model.safetensors")
    assert len(header.checksum) == 64 and TABLE_KEY in header.metadata
    rc = main(["generate", "--checkpoint", str(run_dir), *PROMPT])
    out, _ = capsys.readouterr()
    assert rc == 0 and len(json.loads(out)["token_ids"]) == 4


def test_one_flipped_bit_in_run_weights_is_one_error_line_from_the_cli(run_dir):
    """The issue's reproduction, as a user runs it: exit code != 0, no output, one line naming the file."""
    file = run_dir / "model.safetensors"
    _flip_data_bit(file)
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "generate", "--checkpoint", str(run_dir), *PROMPT],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("lockstep: weights error: ") and str(file) in lines[0] and "sha256" in lines[0]


def test_truncated_run_weights(run_dir, capsys):
    file = run_dir / "model.safetensors"
    os.truncate(file, file.stat().st_size - 1000)
    err = _generate_fails(capsys, run_dir)
    assert str(file) in err and "truncated" in err


def test_corrupt_header_not_json(run_dir, capsys):
    file = run_dir / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[9] = ord("#")  # inside the JSON header
    file.write_bytes(bytes(data))
    err = _generate_fails(capsys, run_dir)
    assert str(file) in err and "bad header" in err


def test_corrupt_header_still_json_is_caught_by_the_table_checksum(run_dir, capsys):
    """A bit flip that keeps the header valid JSON ("pt" -> "pu") is named as a damaged header."""
    file = run_dir / "model.safetensors"
    raw = file.read_bytes()
    position = raw.index(b'"format":"pt"') + len(b'"format":"p')
    _flip_bit(file, position, 0)
    err = _generate_fails(capsys, run_dir)
    assert str(file) in err and "does not match its checksum" in err


def test_run_weights_without_checksums_need_the_flag_and_say_so(run_dir, capsys):
    """A run written before checksums (plain safetensors): refused naming the flag; with it, loaded + warned."""
    file = run_dir / "model.safetensors"
    save_file(load_file(file), file)
    err = _generate_fails(capsys, run_dir)
    assert str(file) in err and FLAG in err
    with pytest.warns(UnverifiedWeightsWarning, match="unverified"):
        rc = main(["generate", "--checkpoint", str(run_dir), *PROMPT, FLAG])
    out, _ = capsys.readouterr()
    assert rc == 0 and len(json.loads(out)["token_ids"]) == 4


def test_the_flag_never_loads_a_file_that_fails_its_checksum(run_dir, capsys):
    file = run_dir / "model.safetensors"
    _flip_data_bit(file)
    err = _generate_fails(capsys, run_dir, FLAG)
    assert str(file) in err and "sha256" in err


# -- Hugging Face exports and lockstep directories ---------------------------------------------------------


def test_hf_export_round_trip_is_verified(tmp_path):
    model = _small_model()
    save_hf(model, tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    assert read_header(file).checksum is not None
    assert _equal_states(load_hf(tmp_path / "hf", dtype=torch.float32), model)
    plain = load_file(file)  # still an ordinary safetensors file
    assert set(plain) == set(read_header(file).entries)
    _flip_data_bit(file)
    with pytest.raises(WeightsError, match=f"{file}: corrupt weights file: sha256"):
        load_hf(tmp_path / "hf")


def test_multi_shard_export_verifies_every_shard(tmp_path):
    model = _small_model()
    out = tmp_path / "hf"
    save_hf(model, out, max_shard_bytes=200_000)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["lockstep_data_sha256"] == {s.name: read_header(s).checksum for s in shards}
    assert _equal_states(load_hf(out, dtype=torch.float32), model)
    # a damaged shard is named
    _flip_data_bit(shards[1])
    with pytest.raises(WeightsError, match=f"{shards[1]}: corrupt weights file: sha256"):
        load_hf(out)
    # a shard of another export (whole, and verifying by itself) does not fit the index
    save_hf(model, out, max_shard_bytes=200_000)
    save_hf(build_model(model.config, seed=1), tmp_path / "other", max_shard_bytes=200_000)
    shutil.copyfile(tmp_path / "other" / shards[2].name, shards[2])
    with pytest.raises(WeightsError, match=f"{shards[2]}: its checksum differs from the one "
                                           "model.safetensors.index.json records"):
        load_hf(out)


def test_convert_both_ways_writes_verified_directories(run_dir, tmp_path, capsys):
    assert main(["convert", "--to-hf", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ls")]) == 0
    capsys.readouterr()
    for file in (tmp_path / "hf" / "model.safetensors", tmp_path / "ls" / "model.safetensors"):
        assert read_header(file).checksum is not None
    assert _equal_states(load_lockstep_dir(tmp_path / "ls"), load_lockstep_dir(run_dir))


def test_lockstep_dir_damage_is_named(tmp_path):
    model = _small_model()
    save_lockstep_dir(model, tmp_path)
    assert _equal_states(load_lockstep_dir(tmp_path), model)
    file = tmp_path / "model.safetensors"
    _flip_bit(file, file.stat().st_size - 1, 7)  # the very last byte of the data
    with pytest.raises(WeightsError, match=f"{file}: corrupt weights file: sha256"):
        load_model(tmp_path, tokenizer=False)


# -- third-party files: the opt-out ---------------------------------------------------------------------


def test_transformers_directory_needs_the_flag(make_hf_dir):
    hf, path = make_hf_dir("llama")
    with pytest.raises(WeightsError) as err:
        load_hf(path)
    message = str(err.value)
    assert str(path / "model.safetensors") in message and FLAG in message and "allow_unverified=True" in message
    with pytest.warns(UnverifiedWeightsWarning, match=str(path / "model.safetensors")):
        model = load_model(path, tokenizer=False, allow_unverified=True).model
    tokens = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        assert torch.allclose(model(tokens), hf(tokens).logits, atol=1e-4, rtol=0)  # fp32 reorderings only


def test_plain_safetensors_lockstep_dir_needs_the_flag(tmp_path):
    model = _small_model()
    save_lockstep_dir(model, tmp_path)
    file = tmp_path / "model.safetensors"
    save_file(load_file(file), file, metadata={"format": "pt"})  # as a third-party tool re-saves it
    with pytest.raises(WeightsError, match=f"{file}: carries no lockstep checksums.*{FLAG}"):
        load_lockstep_dir(tmp_path)
    with pytest.warns(UnverifiedWeightsWarning):
        assert _equal_states(load_lockstep_dir(tmp_path, allow_unverified=True), model)


# -- the file format itself -----------------------------------------------------------------------------


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw[:5], "truncated: 5 bytes"),
    (lambda raw: raw[:8] + raw[8:40], "bad header: it claims"),
    (lambda raw: raw + b"\0" * 8, "8 unexpected bytes after the last tensor"),
    (lambda raw: raw.replace(b'"BF16"', b'"BX16"', 1), "bad header: tensor 'b'"),
])
def test_read_header_names_each_kind_of_damage(tmp_path, damage, message):
    file = tmp_path / "w.safetensors"
    write_weights({"a": torch.randn(4, 3), "b": torch.randn(5, dtype=torch.bfloat16)}, file)
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(WeightsError, match=f"{file}: corrupt weights file: {message}"):
        read_tensors(read_header(file))


def test_written_file_is_standard_safetensors_and_reads_back_bitwise(tmp_path):
    tensors = {"w": torch.randn(300, 1000), "h": torch.randn(7, dtype=torch.bfloat16), "i": torch.arange(9),
               "flag": torch.tensor(True), "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5)}
    file = tmp_path / "w.safetensors"
    digest = write_weights(tensors, file, metadata={"note": "x"})
    header = read_header(file)
    assert header.checksum == header.metadata[DATA_KEY] == digest and header.metadata["note"] == "x"
    for loaded in (load_file(file), read_tensors(header)):
        assert loaded.keys() == tensors.keys()
        assert all(loaded[k].dtype == v.dtype and torch.equal(loaded[k], v) for k, v in tensors.items())
    part = read_tensors(header, ["h"], dtype=torch.float32)  # the rest is still hashed
    assert list(part) == ["h"] and part["h"].dtype == torch.float32


def test_init_from_an_unverifiable_directory_needs_the_config_field(tmp_path):
    """A trainer's init_from goes through the same check; ``--allow-unverified-weights`` sets the field."""
    from lockstep.cli import resolve_config
    from lockstep.train.trainer import Trainer

    argv = ["--recipe", "debug", "--steps", "1", "--output.no-progress", "--output.sample-tokens", "0"]
    cfg, _ = resolve_config([*argv, "--run-dir", str(tmp_path / "a")])
    source = build_model(cfg.model, seed=7)
    save_hf(source, tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    save_file(load_file(file), file, metadata={"format": "pt"})  # as transformers writes it
    cfg, _ = resolve_config([*argv, "--run-dir", str(tmp_path / "a"), "--init-from", str(tmp_path / "hf")])
    with pytest.raises(WeightsError, match=f"{file}: carries no lockstep checksums.*{FLAG}"):
        Trainer(cfg)
    cfg, _ = resolve_config([*argv, "--run-dir", str(tmp_path / "b"), "--init-from", str(tmp_path / "hf"), FLAG])
    assert cfg.allow_unverified_weights
    with pytest.warns(UnverifiedWeightsWarning):
        trainer = Trainer(cfg)
    assert _equal_states(trainer.model, source)


def test_block_checksums_name_the_damaged_tensor(tmp_path, monkeypatch):
    """Data is hashed per block (in parallel); a mismatch names the block's byte range and tensors."""
    from lockstep.models.hf import verified

    monkeypatch.setattr(verified, "BLOCK_BYTES", 4096)
    tensors = {f"t{i}": torch.randn(1024) for i in range(8)}  # 4 KiB each: one block per tensor
    file = tmp_path / "w.safetensors"
    write_weights(tensors, file)
    header = read_header(file)
    assert header.block_bytes == 4096 and len(header.checksum.split(",")) == 8
    assert all(torch.equal(v, tensors[k]) for k, v in read_tensors(header).items())
    _flip_bit(file, header.data_start + header.entries["t5"].begin + 100, 3)
    with pytest.raises(WeightsError, match=r"sha256 of data bytes \[20480, 24576\) \(tensor\(s\) t5\) .* "
                                           r"1 of 8 block\(s\) differ"):
        read_tensors(read_header(file))


def test_a_failed_write_is_one_error_naming_the_file_and_leaves_nothing(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    target = tmp_path / "file" / "model.safetensors"
    with pytest.raises(WeightsError, match=f"^{target}: writing the weights failed: Not a directory$"):
        write_weights({"a": torch.ones(3)}, target)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
