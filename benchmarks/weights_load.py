"""What verifying weights costs: reading a model's safetensors file into memory with lockstep's
verifying reader vs safetensors' own loader, in the same run.

One file of fp32 tensors shaped like a small llama (``--mb`` of data, ~12 tensors per layer), written
once with lockstep's ``write_weights`` (checksummed; safetensors reads it unchanged) and once with
``safetensors.torch.save_file``. Each round, from the page cache (a warm-up read first):

- ``safetensors``: ``load_file`` (lazy, memory-mapped) then ``clone()`` of every tensor, so the
  bytes are in process memory, as after lockstep's read;
- ``lockstep verified``: ``read_header`` + ``read_tensors`` of the checksummed file (every byte
  read once into its tensor; each 32 MiB block sha256-hashed on a thread pool while reading goes on);
- ``lockstep unverified``: the same reader on the file without checksums (what
  ``--allow-unverified-weights`` does): the cost of the read alone;
- ``sha256 alone``: one ``hashlib.sha256`` over the same bytes already in memory, on one core
  (what a single-stream sha256 check costs; the block hashes split it over the cores).

Medians over ``--rounds``, and the ratio to safetensors.

    .venv/bin/python benchmarks/weights_load.py [--mb 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lockstep.models.hf.verified import read_header, read_tensors, write_weights


def _tensors(mb: int) -> dict[str, torch.Tensor]:
    dim = 1024
    per_layer = 4 * dim * dim + 3 * dim * 2816 + 2 * dim  # attention, SwiGLU, norms (fp32 elements)
    layers = max(1, mb * 2**20 // (4 * per_layer))
    gen = torch.Generator().manual_seed(0)
    out = {"tok_embeddings.weight": torch.randn(8192, dim, generator=gen)}
    for i in range(layers):
        for name in ("wq", "wk", "wv", "wo"):
            out[f"layers.{i}.attention.{name}.weight"] = torch.randn(dim, dim, generator=gen)
        for name, shape in (("w1", (2816, dim)), ("w2", (dim, 2816)), ("w3", (2816, dim))):
            out[f"layers.{i}.feed_forward.{name}.weight"] = torch.randn(shape, generator=gen)
        out[f"layers.{i}.attention_norm.weight"] = torch.ones(dim)
        out[f"layers.{i}.ffn_norm.weight"] = torch.ones(dim)
    return out


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=512, help="approximate size of the weights in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tensors = _tensors(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with tempfile.TemporaryDirectory() as tmp:
        ours, plain = Path(tmp) / "ours.safetensors", Path(tmp) / "plain.safetensors"
        write_weights(tensors, ours)
        save_file(tensors, str(plain))
        flat = torch.cat([t.reshape(-1) for t in tensors.values()]).view(torch.uint8).numpy()
        del tensors

        def safetensors_load() -> None:
            loaded = load_file(str(plain))
            [t.clone() for t in loaded.values()]

        sides = {
            "safetensors (load_file + clone)": safetensors_load,
            "lockstep verified": lambda: read_tensors(read_header(ours)),
            "lockstep unverified": lambda: read_tensors(read_header(plain)),
            "sha256 alone (in memory)": lambda: hashlib.sha256(flat).hexdigest(),
        }
        times: dict[str, list[float]] = {name: [] for name in sides}
        for fn in sides.values():  # warm the page cache and the allocator
            fn()
        for _ in range(args.rounds):  # interleaved: this host's speed drifts
            for name, fn in sides.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["safetensors (load_file + clone)"])
    print(f"{nbytes / 2**20:.0f} MiB of fp32 weights, {args.rounds} rounds, torch threads "
          f"{torch.get_num_threads()}, {_cpu()}")
    print(f"{'side':34s} {'median s':>9s} {'GB/s':>6s} {'vs safetensors':>15s}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:34s} {median:9.3f} {nbytes / median / 1e9:6.2f} {median / base:14.2f}x")


if __name__ == "__main__":
    main()
