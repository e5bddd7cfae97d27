"""``lockstep serve`` from the command line: flags checked before loading (exit 2, naming the flag),
``--engine vllm`` without lockstep.vllm is a clear error, and a real server process answers the
openai client with the engine's greedy text and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from lockstep.cli import main
from lockstep.generate import Request, SamplingParams
from lockstep.serve.cli import build_engine, image_limits, parse_args
from lockstep.serve.images import ImageLimits
from tests.serve.conftest import load

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "--port: must be in [0, 65535]"),
    (["--max-batch-size", "0"], "--max-batch-size: must be >= 1"),
    (["--max-queue", "-1"], "--max-queue: must be >= 0"),
    (["--cache-mb", "0"], "--cache-mb: must be > 0"),
    (["--default-max-tokens", "0"], "--default-max-tokens: must be >= 1"),
    (["--served-model-name", " "], "--served-model-name: must not be empty"),
    (["--allowed-image-dir", "/nonexistent/images"], "--allowed-image-dir /nonexistent/images: no such directory"),
    (["--max-images-per-request", "0"], "--max-images-per-request: must be >= 1"),
    (["--max-image-pixels", "0"], "--max-image-pixels: must be >= 1"),
])
def test_bad_flags_fail_before_loading(model_dir, capsys, flags, message):
    assert main(["serve", "--checkpoint", str(model_dir), *flags]) == 2
    assert message in capsys.readouterr().err


def test_image_flags_are_the_servers_image_limits(model_dir, tmp_path):
    args = parse_args(["--checkpoint", str(model_dir), "--allowed-image-dir", str(tmp_path),
                       "--max-images-per-request", "2", "--max-image-pixels", "100"])
    assert image_limits(args) == ImageLimits(max_images=2, max_pixels=100, allowed_dir=tmp_path)
    assert image_limits(parse_args(["--checkpoint", str(model_dir)])).allowed_dir is None  # no file:// by default


def test_missing_checkpoint(tmp_path, capsys):
    assert main(["serve", "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_engine_vllm_without_lockstep_vllm_is_a_clear_error(model_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lockstep.vllm", None)  # as if the package were absent
    assert main(["serve", "--checkpoint", str(model_dir), "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "--engine vllm: the vLLM engine (lockstep.vllm) is not part of this installation" in err


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_process_answers_the_openai_client(model_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--checkpoint", str(model_dir),
                             "--port", str(port), "--served-model-name", "tiny", "--cache-mb", "16",
                             "--max-batch-size", "4", "--log-level", "warning"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                health = urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read()
                assert json.loads(health)["status"] == "ok"
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "To be, or not"}]
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        source = load(model_dir)
        engine = build_engine("lockstep", source.model, source.tokenizer, cache_mb=16, max_batch_size=4)
        [want] = engine.generate([Request(prompt_ids=source.chat_template.encode(source.tokenizer, messages),
                                          sampling=SamplingParams(max_new_tokens=8, temperature=0))])
        assert out.choices[0].message.content == want.text
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    output = (tmp_path / "serve.log").read_text()
    # uvicorn shuts down gracefully, then re-raises the signal it caught: the process ends by SIGTERM
    assert code == -signal.SIGTERM and "Traceback" not in output, output
    assert f"on http://127.0.0.1:{port}/v1" in output
