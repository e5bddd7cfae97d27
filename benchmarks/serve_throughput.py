"""``lockstep serve`` throughput: N concurrent streaming clients over HTTP vs the same Engine in-process.

The competitor is the engine itself: ``Engine.generate`` of the same N requests in this process
(no HTTP, no JSON, no event loop). The server side is a ``lockstep serve`` process (the CLI, on
127.0.0.1, same checkpoint, dtype, max batch size and KV-cache size) with N client threads in this
process each streaming one completion (``stream: true``) at once. Both: greedy, the same prompt,
``--new-tokens`` new tokens each (``ignore_eos``), 2 torch threads; sides interleaved round by round
(the host's speed drifts). Output tokens/s = all generated tokens over the wall time of the whole
batch (prefill included); the server row also gives the median time to first token. The ratio
server / engine is what serving costs (1.0 = nothing).

The in-process side runs on a worker thread, like the server's engine loop: on this 2-vCPU host
under load (load average ~25 from other jobs), the same engine ran ~20x slower on the main thread
than on a worker thread (a 2-thread OpenMP team on the main thread waits for descheduled workers;
a bare ``F.linear`` [1, 576] x [576, 1536] took 16.9 ms on the main thread vs 0.2 ms on a worker
thread, 2026-12-05), which would make the server look faster than the engine. The clients are not
in the server's process: their Python work would contend for the server's GIL.

    .venv/bin/python benchmarks/serve_throughput.py [--checkpoint smollm2] [--clients 1,8] [--new-tokens 64]
        [--rounds 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
from lockstep.load import load_model

PROMPT = "The history of the printing press begins in"
CACHE_MB = 256


class serve_process:
    """``lockstep serve`` in a child process on a free port; ``with serve_process(...) as base_url``."""

    def __init__(self, args: argparse.Namespace, max_batch: int) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep.cli", "serve", "--checkpoint", args.checkpoint, "--port", str(self.port),
             "--served-model-name", "bench", "--dtype", args.dtype, "--max-batch-size", str(max_batch),
             "--max-queue", "0", "--cache-mb", str(CACHE_MB), "--log-level", "warning"],
            cwd=root, env={**os.environ, "PYTHONPATH": str(root)})

    def __enter__(self) -> str:
        base_url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                httpx.get(base_url + "/health").raise_for_status()
                return base_url
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("lockstep serve did not start") from None
                time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def engine_side(engine: Engine, prompt_ids: list[int], clients: int, new_tokens: int) -> float:
    """``Engine.generate`` of the batch, on a fresh thread (as the server's engine loop runs: see the
    module docstring)."""
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    out: list[float] = []

    def run() -> None:
        start = time.perf_counter()
        results = engine.generate([Request(prompt_ids=prompt_ids, sampling=sampling) for _ in range(clients)])
        out.append(time.perf_counter() - start)
        assert all(len(r.token_ids) == new_tokens for r in results)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return clients * new_tokens / out[0]


def server_side(base_url: str, prompt_ids: list[int], clients: int, new_tokens: int) -> tuple[float, float]:
    body = {"model": "bench", "prompt": prompt_ids, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    counts, firsts = [0] * clients, [0.0] * clients
    barrier = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        barrier.wait()
        sent = time.perf_counter()
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                ids = json.loads(line[6:])["choices"][0]["token_ids"]
                if ids and not counts[i]:
                    firsts[i] = time.perf_counter() - sent
                counts[i] += len(ids)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    assert counts == [new_tokens] * clients, counts
    return sum(counts) / wall, statistics.median(firsts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2")
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    config = EngineConfig(cache_memory_mb=CACHE_MB, max_batch_size=max(clients))

    def engine() -> tuple[Engine, object]:
        source = load_model(args.checkpoint, dtype=args.dtype)
        source.model.eval()
        return Engine(source.model, source.tokenizer, config), source

    direct, source = engine()
    prompt_ids = source.tokenizer.encode(PROMPT)
    print(f"{source.description}, {args.dtype}, prompt {len(prompt_ids)} tokens, {args.new_tokens} new tokens, "
          f"torch threads {torch.get_num_threads()}")
    rows: dict[int, dict[str, list[float]]] = {c: {"engine": [], "server": [], "ttft": []} for c in clients}
    with serve_process(args, max(clients)) as base_url:
        for c in clients:  # warm-up: first steps of each batch size (kernels, packing)
            engine_side(direct, prompt_ids, c, 4)
            server_side(base_url, prompt_ids, c, 4)
        for _ in range(args.rounds):
            for c in clients:
                rows[c]["engine"].append(engine_side(direct, prompt_ids, c, args.new_tokens))
                tps, ttft = server_side(base_url, prompt_ids, c, args.new_tokens)
                rows[c]["server"].append(tps)
                rows[c]["ttft"].append(ttft)
        stats = json.loads(httpx.get(base_url + "/stats").read())
    print(f"{'clients':>7} {'engine tok/s':>13} {'server tok/s':>13} {'ratio (median)':>15} {'ratio (best)':>13} "
          f"{'server TTFT ms':>15}")
    for c in clients:
        r = rows[c]
        ratios = [s / e for s, e in zip(r["server"], r["engine"])]
        print(f"{c:>7} {statistics.median(r['engine']):>13.1f} {statistics.median(r['server']):>13.1f} "
              f"{statistics.median(ratios):>15.2f} {max(r['server']) / max(r['engine']):>13.2f} "
              f"{1000 * statistics.median(r['ttft']):>15.0f}")
    print(f"server engine loop: {stats['steps']} steps ({stats['step_seconds']:.1f} s inside engine.step), most "
          f"requests in one step {stats['max_active']}, {stats['batched_steps']} batched steps")
    print(f"server seconds per step {stats['step_seconds'] / stats['steps']:.3f} (all batch sizes, warm-up included)")


if __name__ == "__main__":
    main()
