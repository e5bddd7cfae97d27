"""The in-process checks of ``scripts/gpu_check.sh``: one line each, ``PASS|FAIL|SKIP name: detail``.

    python scripts/gpu_checks.py --device cuda            # every check
    python scripts/gpu_checks.py --device cpu hf-parity   # one

- ``hf-parity``: a tiny random Llama built by transformers from an HF config, saved with
  ``save_pretrained`` and loaded by lockstep (``load_hf``) onto the device: full-sequence fp32 logits
  within ``LOGITS_TOL`` of transformers', and the engine's greedy tokens equal transformers'
  ``generate`` (greedy).
- ``batch-invariant``: the trainer's ``score_logprobs`` and the engine's sampled log-probabilities,
  bitwise (``torch.equal``), in batch-invariant mode. The mode is CPU-only: off the CPU the check
  passes if the engine refuses it with a ConfigError, and reports (does not judge) whether the
  trainer's tiled torch-op path gives a sequence the same bits alone and in a batch there.
- ``checkpoint``: device tensors saved through the shared-memory staging buffer (writer process)
  and loaded back bitwise, with the tensors overwritten right after ``save`` returns.
- ``transport``: a model's state through the RL weight-sync byte buffer on the device, bitwise.

Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

#: fp32 logits of lockstep vs transformers on one device (TF32 off): the same math in other kernels
#: (SDPA vs eager attention, other GEMM tilings) differs by rounding only, ~1e-6 of logits that are
#: O(5) here (4e-6 measured on the CPU, where the parity tests allow 1e-4); 2e-4 leaves room for
#: other reduction orders without hiding a wrong weight or mask (those move logits by O(0.1))
LOGITS_TOL = 2e-4
#: the tiny model every check uses (transformers LlamaConfig fields)
HF_CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _hf_llama(seed: int = 0):
    """A random transformers LlamaForCausalLM, fp32, with weights large enough that logits are not ~0."""
    import transformers

    config = transformers.LlamaConfig(**HF_CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if p.ndim == 1
                    else 0.15 * torch.randn(p.shape, generator=gen))
    return model


def _prompts(n: int, length: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, HF_CONFIG["vocab_size"], (length + i,), generator=gen).tolist() for i in range(n)]


def check_hf_parity(device: torch.device, tmp: Path) -> tuple[str, str]:
    from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
    from lockstep.models.hf import load_hf

    hf = _hf_llama()
    hf.save_pretrained(tmp / "hf")
    hf = hf.to(device)
    model = load_hf(tmp / "hf", device=device, dtype=torch.float32, allow_unverified=True).eval()  # transformers wrote it
    tokens = torch.tensor(_prompts(1, 48)[0], device=device)[None].repeat(2, 1)
    tokens[1] = tokens[1].roll(7)
    with torch.no_grad():
        expected, got = hf(tokens).logits, model(tokens)
    diff = (expected - got).abs().max().item()
    if not diff <= LOGITS_TOL:
        return "FAIL", f"max |logits diff| {diff:.3g} > {LOGITS_TOL} on {device}"
    prompts, new = _prompts(3, 5), 16
    engine = Engine(model, None, EngineConfig(cache_memory_mb=4, block_size=8))
    results = engine.generate([Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=new, temperature=0,
                                                                             ignore_eos=True)) for p in prompts])
    hf.generation_config.eos_token_id = None  # run every one of the new tokens, as the engine does
    mismatched = []
    for p, r in zip(prompts, results):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p], device=device), max_new_tokens=new, do_sample=False, pad_token_id=0)
        if out[0, len(p):].tolist() != r.token_ids:
            mismatched.append(p)
    if mismatched:
        return "FAIL", f"greedy tokens differ from transformers for {len(mismatched)}/{len(prompts)} prompts"
    return "PASS", (f"logits max diff {diff:.2g} <= {LOGITS_TOL} (|logits| <= {expected.abs().max().item():.0f}); "
                    f"greedy {len(prompts)}x{new} tokens equal transformers' on {device}")


def _lockstep_llama(device: torch.device):
    import dataclasses

    from lockstep.models.common.transformer import build_model
    from lockstep.models.registry import model_config

    cfg = dataclasses.replace(model_config("llama3", "debug"), vocab_size=HF_CONFIG["vocab_size"])
    return build_model(cfg, seed=0).to(device).eval()


def check_batch_invariant(device: torch.device, tmp: Path) -> tuple[str, str]:
    from lockstep import numerics
    from lockstep.config.base import ConfigError
    from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
    from lockstep.rl.scoring import score_logprobs

    model = _lockstep_llama(device)
    prompts = _prompts(4, 6)
    sampling = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    if device.type != "cpu":
        try:
            Engine(model, None, EngineConfig(cache_memory_mb=4, batch_invariant=True))
        except ConfigError as err:
            refused = str(err).split(":")[0]
        else:
            return "FAIL", f"the engine accepted batch-invariant mode on {device} (it is CPU-only)"
        # what the trainer's tiled torch-op path does here: reported, not judged
        seqs = [p + p[::-1] for p in prompts]
        try:
            with numerics.batch_invariant(True), torch.no_grad():
                alone = [score_logprobs(model, [s], [len(p)])[0] for s, p in zip(seqs, prompts)]
                batched = score_logprobs(model, seqs, [len(p) for p in prompts])
            worst = max((a - b).abs().max().item() for a, b in zip(alone, batched))
            seen = "bitwise equal" if all(torch.equal(a, b) for a, b in zip(alone, batched)) else f"differ (max {worst:.2g})"
        except Exception as err:  # informational: a crash here is reported, not a failed check
            seen = f"raised {type(err).__name__}: {str(err).splitlines()[0][:120]}"
        return "SKIP", (f"CPU-only: the engine refuses it on {device} with a ConfigError ({refused}); "
                        f"trainer scores alone vs batched on {device}: {seen}")
    engine = Engine(model, None, EngineConfig(cache_memory_mb=4, block_size=4, batch_invariant=True))
    results = engine.generate([Request(prompt_ids=p, sampling=s) for p, s in zip(prompts, sampling)])
    with numerics.batch_invariant(True), torch.no_grad():
        scored = score_logprobs(model, [r.prompt_ids + r.token_ids for r in results], [len(p) for p in prompts])
    unequal = [i for i, (r, s) in enumerate(zip(results, scored))
               if not torch.equal(torch.tensor(r.logprobs, dtype=torch.float32), s.cpu())]
    if unequal:
        return "FAIL", f"generator vs trainer log-probs differ for sequences {unequal}"
    return "PASS", f"generator and trainer log-probs bitwise equal ({len(results)} sampled sequences, {device})"


def check_checkpoint(device: torch.device, tmp: Path) -> tuple[str, str]:
    from lockstep.checkpoint import Checkpointer, LocalStorage, Slot

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 1024, generator=gen)
    state = {"model/w": w.to(device), "model/wt": w[:512, :256].to(device).t(),
             "model/b": torch.randn(333, generator=gen).bfloat16().to(device),
             "model/i": torch.arange(7).to(device), "optimizer/w/step": torch.tensor(3.0, device=device)}
    expected = {k: v.clone() for k, v in state.items()}
    ck = Checkpointer(LocalStorage(tmp / "ckpt"), mode="process")
    stats = ck.save(1, {k: Slot.of(v) for k, v in state.items()}, {"note": "gpu_check"}, {})
    for v in state.values():  # staging must be complete when save returns
        v.fill_(0)
    (done,) = ck.wait()
    ck.close()
    if done.error:
        return "FAIL", f"save failed: {done.error}"
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    Checkpointer(LocalStorage(tmp / "ckpt"), mode="sync").load({k: Slot.of(v) for k, v in target.items()})
    bad = [k for k in expected if not torch.equal(target[k], expected[k]) or target[k].device != expected[k].device]
    if bad:
        return "FAIL", f"loaded tensors differ from the saved ones: {bad}"
    return "PASS", (f"{len(state)} {device.type} tensors staged ({stats.blocking_ms:.1f} ms blocking, "
                    f"{done.bytes / 1e6:.1f} MB) and loaded back bitwise")


def check_transport(device: torch.device, tmp: Path) -> tuple[str, str]:
    from lockstep.rl.transport import FlatState

    src, dst = _lockstep_llama(device), _lockstep_llama(device)
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
    flat = FlatState(src)
    buffer = flat.new_buffer()
    flat.pack(buffer)
    FlatState(dst).unpack(buffer)
    same = all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))
    if buffer.device != device or not same:
        return "FAIL", f"buffer on {buffer.device}; state equal after the round trip: {same}"
    return "PASS", f"{flat.nbytes / 1e6:.2f} MB weight-sync buffer on {buffer.device}, state bitwise after unpack"


CHECKS: dict[str, Callable[[torch.device, Path], tuple[str, str]]] = {
    "hf-parity": check_hf_parity, "batch-invariant": check_batch_invariant,
    "checkpoint": check_checkpoint, "transport": check_transport,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("checks", nargs="*", metavar="CHECK", help=f"checks to run (default: all): {', '.join(CHECKS)}")
    args = parser.parse_args(argv)
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {list(CHECKS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        for name in args.checks or CHECKS:
            print(f"FAIL {name}: torch {torch.__version__} sees no CUDA device", flush=True)
        return 1
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32 (no TF32) for the tolerances above
    failed = False
    for name in args.checks or list(CHECKS):
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"lockstep-{name}-") as tmp:
            try:
                status, detail = CHECKS[name](device, Path(tmp))
            except Exception as err:  # a crash is a failed check, reported on its line
                traceback.print_exc(file=sys.stderr)
                status, detail = "FAIL", f"{type(err).__name__}: {err}".splitlines()[0]
        failed |= status == "FAIL"
        print(f"{status} {name}: {detail} [{time.perf_counter() - started:.1f}s]", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
