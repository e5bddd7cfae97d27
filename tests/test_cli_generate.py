"""``lockstep generate`` / ``lockstep chat``: every kind of --checkpoint DIR, chat with piped stdin,
and bad input as a one-line ``lockstep: ...`` error with exit code 2.

Two tiny models: a random llama3 (weights large enough that greedy text is not one repeated token)
saved with ``save_hf`` beside a small BPE tokenizer and a chat template; and a 2-step ``debug``
training run with a checkpoint after each step.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep.cli import main
from lockstep.data.config import DataConfig
from lockstep.data.tokenizer import Tokenizer, train_bpe
from lockstep.generate import Engine, EngineConfig, Request, SamplingParams, load_chat_template
from lockstep.load import load_model
from lockstep.models.common.transformer import build_model
from lockstep.models.hf import config_from_dict, load_hf, load_lockstep_dir, save_hf
from lockstep.models.registry import model_config

TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|endoftext|>assistant:{% endif %}")
TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings "
        "and arrows of outrageous fortune, or to take arms against a sea of troubles. ") * 20


def make_model_dir(path: Path) -> None:
    """A tiny llama3 with a trained tokenizer and a chat template, saved in HF layout at ``path``."""
    tok = train_bpe([TEXT], 320, path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    cfg = dataclasses.replace(model_config("llama3", "debug"), vocab_size=tok.vocab_size)
    model = build_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # as tests/generate's models: logits O(5), so greedy text varies
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if p.ndim == 1
                    else 0.15 * torch.randn(p.shape, generator=gen))
    save_hf(model, path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    make_model_dir(path)
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", "--recipe", "debug", "--steps", "2", "--checkpoint-every", "1", "--checkpoint.mode",
                 "sync", "--output.sample-tokens", "0", "--run-dir", str(path)]) == 0
    assert (path / "checkpoints" / "step-00000002").is_dir() and (path / "model.safetensors").is_file()
    return path


def generate_json(capsys, *argv: str) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def engine_greedy(model, tokenizer, prompt_ids: list[int], n: int) -> list[int]:
    """What the library path gives: the Engine, greedy, on an already-loaded model."""
    engine = Engine(model, tokenizer, EngineConfig(cache_memory_mb=8))
    [result] = engine.generate([Request(prompt_ids=prompt_ids, sampling=SamplingParams(max_new_tokens=n,
                                                                                       temperature=0))])
    return result.token_ids


def test_generate_hf_dir_greedy_is_deterministic_and_is_the_engine(hf_dir, capsys):
    a = generate_json(capsys, "--checkpoint", str(hf_dir), "--prompt", "To be, or not", "--max-new-tokens", "12")
    b = generate_json(capsys, "--checkpoint", str(hf_dir), "--prompt", "To be, or not", "--max-new-tokens", "12")
    assert a == b
    tok = Tokenizer.from_file(hf_dir / "tokenizer.json")
    assert a["prompt_ids"] == tok.encode("To be, or not")
    assert a["token_ids"] == engine_greedy(load_hf(hf_dir, dtype=torch.float32).eval(), tok, a["prompt_ids"], 12)
    assert len(set(a["token_ids"])) > 2  # not a degenerate model
    stop = tok.eos_id in a["token_ids"]
    assert a["finish_reason"] == ("stop" if stop else "length")
    assert a["text"] == tok.decode([t for t in a["token_ids"] if t != tok.eos_id])
    # streamed (no --json): the same text on stdout
    assert main(["generate", "--checkpoint", str(hf_dir), "--prompt", "To be, or not", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == a["text"] + "\n"


def test_generate_chat_flag_applies_the_template(hf_dir, capsys):
    out = generate_json(capsys, "--checkpoint", str(hf_dir), "--prompt", "to be?", "--chat", "--system", "be brief",
                        "--max-new-tokens", "6", "--ignore-eos")
    tok = Tokenizer.from_file(hf_dir / "tokenizer.json")
    rendered = "<|endoftext|>system: be brief\n<|endoftext|>user: to be?\n<|endoftext|>assistant:"
    assert out["prompt_ids"] == tok.encode(rendered)
    assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"


def test_sampling_flags_seeded_sampling_and_stop_token(hf_dir, capsys):
    common = ["--checkpoint", str(hf_dir), "--prompt", "whether", "--max-new-tokens", "10", "--ignore-eos"]
    s1 = generate_json(capsys, *common, "--temperature", "1.5", "--top-k", "50", "--top-p", "0.9", "--seed", "3")
    s2 = generate_json(capsys, *common, "--temperature", "1.5", "--top-k", "50", "--top-p", "0.9", "--seed", "3")
    s3 = generate_json(capsys, *common, "--temperature", "1.5", "--top-k", "50", "--top-p", "0.9", "--seed", "4")
    greedy = generate_json(capsys, *common)
    assert s1 == s2 and s1["token_ids"] != s3["token_ids"] and s1["token_ids"] != greedy["token_ids"]
    stop_id = greedy["token_ids"][3]
    first = greedy["token_ids"].index(stop_id)
    stopped = generate_json(capsys, *common, "--stop-token-id", str(stop_id))
    assert stopped["token_ids"] == greedy["token_ids"][: first + 1] and stopped["finish_reason"] == "stop"


def test_generate_from_run_dir_loads_the_latest_checkpoint(run_dir, capsys):
    source = load_model(run_dir)
    assert source.kind == "checkpoint" and "step 2" in source.description
    final = load_lockstep_dir(run_dir)  # model.safetensors: written after the last step, as checkpoint 2
    state = source.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in final.state_dict().items())
    step1 = load_model(run_dir, step=1).model.state_dict()
    assert not torch.equal(step1["layers.0.attention.wq.weight"], state["layers.0.attention.wq.weight"])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    data = config_from_dict(manifest["recipe"]["data"], DataConfig, "data")
    tok = Tokenizer.from_file(data.resolved_tokenizer_path())  # what the run's data config used
    out = generate_json(capsys, "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "8")
    assert out["prompt_ids"] == tok.encode("ROMEO:")
    assert out["token_ids"] == engine_greedy(final.eval(), tok, out["prompt_ids"], 8)
    # the checkpoint directory itself, and --step
    assert generate_json(capsys, "--checkpoint", str(run_dir / "checkpoints"), "--prompt", "ROMEO:",
                         "--max-new-tokens", "8")["token_ids"] == out["token_ids"]
    assert main(["generate", "--checkpoint", str(run_dir), "--step", "1", "--prompt", "ROMEO:",
                 "--max-new-tokens", "4"]) == 0
    capsys.readouterr()


def test_run_dir_without_checkpoints_uses_its_model_safetensors(run_dir, tmp_path, capsys):
    copy = tmp_path / "weights-only"
    copy.mkdir()
    for name in ("manifest.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(run_dir / name, copy / name)
    assert load_model(copy).kind == "run-weights"
    a = generate_json(capsys, "--checkpoint", str(copy), "--prompt", "ROMEO:", "--max-new-tokens", "8")
    b = generate_json(capsys, "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "8")
    assert a["token_ids"] == b["token_ids"]


class RecordingIO(io.StringIO):
    """A stdout that remembers each write (to see that replies are streamed, not printed whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_chat_streams_replies_and_keeps_the_history(hf_dir):
    from lockstep.cli_generate import cmd_chat

    stdin = io.StringIO("to be\n\nor not to be\n/exit\nnever read\n")
    stdout = RecordingIO()
    assert cmd_chat(["--checkpoint", str(hf_dir), "--max-new-tokens", "8", "--ignore-eos"], stdin, stdout) == 0
    replies = stdout.getvalue().split("\n")
    assert len(replies) == 3 and replies[2] == ""  # two turns (the empty line is skipped), then /exit
    assert len([w for w in stdout.writes if w not in ("", "\n")]) > 2  # token by token
    # the second reply is what the model says to the whole conversation, first reply included
    model, tok = load_hf(hf_dir, dtype=torch.float32).eval(), Tokenizer.from_file(hf_dir / "tokenizer.json")
    template = load_chat_template(hf_dir)
    history = [{"role": "user", "content": "to be"}, {"role": "assistant", "content": replies[0]},
               {"role": "user", "content": "or not to be"}]
    engine = Engine(model, tok, EngineConfig(cache_memory_mb=8))
    [want] = engine.generate([Request(prompt_ids=template.encode(tok, history),
                                      sampling=SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))])
    assert replies[1] == want.text


def test_chat_console_script_with_piped_stdin(run_dir, hf_dir, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "chat", "--checkpoint", str(run_dir),
                           "--chat-template", str(template), "--max-new-tokens", "5"],
                          input="hello\nwho are you\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 2 and "Traceback" not in proc.stderr  # one reply per line, EOF ends


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "{missing}", "--prompt", "hi"], r"--checkpoint .*: no such directory"),
    (["--checkpoint", "{file}", "--prompt", "hi"], r"--checkpoint .*: not a directory"),
    (["--checkpoint", "{empty}", "--prompt", "hi"], r"--checkpoint .*: not a model directory: expected"),
    (["--checkpoint", "{hf}", "--prompt", ""], r"--prompt: must not be empty"),
    (["--checkpoint", "{hf}", "--prompt", "hi", "--temperature", "-0.5"], r"--temperature: must be >= 0"),
    (["--checkpoint", "{hf}", "--prompt", "hi", "--top-p", "0"], r"--top-p: must be in \(0, 1\]"),
    (["--checkpoint", "{hf}", "--prompt", "hi", "--top-p", "1.5"], r"--top-p: must be in \(0, 1\]"),
    (["--checkpoint", "{hf}", "--prompt", "hi", "--max-new-tokens", "0"], r"--max-new-tokens: must be an integer"),
    (["--checkpoint", "{hf}", "--prompt", "hi", "--step", "1"], r"--step: .* is a model directory"),
    (["--checkpoint", "{run}", "--prompt", "hi", "--step", "7"], r"step-00000007.*no such checkpoint"),
    (["--checkpoint", "{run}", "--prompt", "hi", "--chat"], r"no chat template.*--chat-template"),
    (["--checkpoint", "{manifest_only}", "--prompt", "hi"], r"a training run without weights"),
    (["--checkpoint", "{hf}", "--prompt", "hi", "--chat-template", "{missing}"], r"--chat-template .*: no such file"),
    (["--checkpoint", "{hf}", "--prompt", "hi", "--device", "tpu"], r"--device: must be one of \['auto', 'cpu', 'cuda'\]"),
])
def test_bad_input_is_one_line_error_exit_2(argv, message, hf_dir, run_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "manifest_only").mkdir()
    shutil.copyfile(run_dir / "manifest.json", tmp_path / "manifest_only" / "manifest.json")
    paths = {"missing": tmp_path / "nope", "file": tmp_path / "file", "empty": tmp_path / "empty", "hf": hf_dir,
             "run": run_dir, "manifest_only": tmp_path / "manifest_only"}
    argv = [a.format(**paths) for a in argv]
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockstep: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


def test_console_script_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "chat", "--checkpoint", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("lockstep: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "no such directory" in proc.stderr and "Traceback" not in proc.stderr


def test_device_flag(hf_dir, capsys):
    """``--device cpu`` runs where ``auto`` runs on a CPU machine; ``cuda`` without CUDA is a one-line error."""
    argv = ["generate", "--checkpoint", str(hf_dir), "--prompt", "ab", "--max-new-tokens", "4", "--json"]
    assert main([*argv, "--device", "cpu"]) == 0
    on_cpu = json.loads(capsys.readouterr().out)
    if torch.cuda.is_available():
        assert main([*argv, "--device", "cuda"]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == on_cpu["token_ids"]
    else:
        assert main([*argv, "--device", "cuda"]) == 2
        assert re.search(r"^lockstep: (config error: )?--device: 'cuda' was asked for.*no CUDA device", capsys.readouterr().err)
