"""``lockstep serve`` throughput: N concurrent streaming clients over HTTP vs the same Engine in-process.

The competitor is the engine itself: ``Engine.generate`` of the same N requests in this process
(no HTTP, no JSON, no event loop). The server side is a ``lockstep serve`` process (the CLI, on
127.0.0.1, same checkpoint, dtype, max batch size and KV-cache size) with N client threads in this
process each streaming one completion (``stream: true``) at once. Both: greedy, the same prompt,
``--new-tokens`` new tokens each (``ignore_eos``), 2 torch threads; sides interleaved round by round
(the host's speed drifts). Output tokens/s = all generated tokens over the wall time of the whole
batch (prefill included). Latencies, per side and client count over every round: time to first token
(request sent -> first token received) and inter-token latency (gap between a request's successive
tokens), p50/p90/p99. The ratio server / engine is what serving costs (1.0 = nothing); who goes first
alternates round by round.

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
import openai
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


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


class Latencies:
    """Per-request time to first token and per-token gaps after it (seconds), over every round."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []

    def add(self, sent: float, arrivals: list[tuple[float, int]]) -> None:
        """``arrivals``: (time, tokens that arrived then) of one request, in order."""
        self.ttft.append(arrivals[0][0] - sent)
        for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
            self.itl.extend([(t1 - t0) / n] * n)

    def summary(self) -> str:
        ms = lambda v, q: f"{1000 * percentile(v, q):.0f}"  # noqa: E731
        return (f"TTFT p50/p90/p99 {ms(self.ttft, 50)}/{ms(self.ttft, 90)}/{ms(self.ttft, 99)} ms, "
                f"inter-token p50/p90/p99 {ms(self.itl, 50)}/{ms(self.itl, 90)}/{ms(self.itl, 99)} ms")


def engine_side(engine: Engine, prompt_ids: list[int], clients: int, new_tokens: int,
                latencies: Latencies | None = None) -> float:
    """``Engine.stream`` of the batch, on a fresh thread (as the server's engine loop runs: see the
    module docstring); token arrival times from its events."""
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    out: list[float] = []
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(clients)]

    def run() -> None:
        start = time.perf_counter()
        for event in engine.stream([Request(prompt_ids=prompt_ids, sampling=sampling) for _ in range(clients)]):
            arrivals[event.index].append((time.perf_counter(), 1))
        out.append(time.perf_counter() - start)
        out.append(start)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert [len(a) for a in arrivals] == [new_tokens] * clients, [len(a) for a in arrivals]
    if latencies is not None:
        for a in arrivals:
            latencies.add(out[1], a)
    return clients * new_tokens / out[0]


def server_side(base_url: str, prompt_ids: list[int], clients: int, new_tokens: int,
                latencies: Latencies | None = None) -> float:
    """N threads, each an ``openai.OpenAI`` client streaming one completion at once."""
    counts = [0] * clients
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(clients)]
    sent = [0.0] * clients
    barrier = threading.Barrier(clients + 1)
    extra = {"ignore_eos": True, "return_token_ids": True}

    def client(i: int) -> None:
        api = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=600, max_retries=0)
        barrier.wait()
        sent[i] = time.perf_counter()
        stream = api.completions.create(model="bench", prompt=prompt_ids, max_tokens=new_tokens, temperature=0,
                                        stream=True, extra_body=extra)
        for chunk in stream:
            ids = (chunk.choices[0].model_extra or {}).get("token_ids") if chunk.choices else None
            if ids:
                arrivals[i].append((time.perf_counter(), len(ids)))
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
    if latencies is not None:
        for i in range(clients):
            latencies.add(sent[i], arrivals[i])
    return sum(counts) / wall


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
          f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()}", flush=True)
    rows = {c: {"engine": [], "server": [], "lat_engine": Latencies(), "lat_server": Latencies()} for c in clients}
    with serve_process(args, max(clients)) as base_url:
        for c in clients:  # warm-up: first steps of each batch size (kernels, packing)
            engine_side(direct, prompt_ids, c, 4)
            server_side(base_url, prompt_ids, c, 4)
        for r in range(args.rounds):
            for c in clients:
                sides = [("engine", engine_side, direct), ("server", server_side, base_url)]
                for name, run, target in sides if r % 2 == 0 else sides[::-1]:  # alternate who goes first
                    rows[c][name].append(run(target, prompt_ids, c, args.new_tokens, rows[c][f"lat_{name}"]))
        stats = json.loads(httpx.get(base_url + "/stats").read())
    print(f"load average after: {os.getloadavg()}")
    print(f"{'clients':>7} {'engine tok/s':>13} {'server tok/s':>13} {'ratio (median)':>15} {'range':>11} "
          f"{'ratio (best)':>13}")
    for c in clients:
        r = rows[c]
        ratios = [s / e for s, e in zip(r["server"], r["engine"])]
        print(f"{c:>7} {statistics.median(r['engine']):>13.1f} {statistics.median(r['server']):>13.1f} "
              f"{statistics.median(ratios):>15.2f} {min(ratios):>5.2f}-{max(ratios):<5.2f} "
              f"{max(r['server']) / max(r['engine']):>13.2f}")
    for c in clients:
        print(f"{c:>3} clients: engine {rows[c]['lat_engine'].summary()}")
        print(f"{c:>3} clients: server {rows[c]['lat_server'].summary()}")
    print(f"server engine loop: {stats['steps']} steps ({stats['step_seconds']:.1f} s inside engine.step), most "
          f"requests in one step {stats['max_active']}, {stats['batched_steps']} batched steps")
    print(f"server seconds per step {stats['step_seconds'] / stats['steps']:.3f} (all batch sizes, warm-up included)")


if __name__ == "__main__":
    main()
