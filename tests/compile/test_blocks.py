"""Whole-block compilation (``compile.modules``): one compiled code object serves every matched
layer, the result is bitwise eager with aot_eager (wrapped in activation checkpointing too), globs
follow the override rule (dead globs are errors), and the Trainer trains with it."""

import copy
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from lockstep.compile.blocks import apply_compile
from lockstep.compile.config import CompileConfig
from lockstep.compile.local import regions_enabled
from lockstep.config.base import ConfigError
from lockstep.graph.state import capturing
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.checkpointing import apply_activation_checkpointing
from lockstep.recipes import get_recipe
from lockstep.train.trainer import Trainer

pytestmark = pytest.mark.xdist_group("compile")


def _model(n_layers=4):
    return build_model(dataclasses.replace(model_config("llama3", "debug"), n_layers=n_layers), seed=0)


def _forward_backward(model, tokens):
    logits = model(tokens)
    logits.float().pow(2).mean().backward()
    return logits, [p.grad for p in model.parameters()]  # same order with or without wrappers


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("checkpoint", ["none", "full", "selective"])
def test_one_compile_serves_every_layer_bitwise_with_aot_eager(checkpoint):
    eager = _model()
    model = apply_activation_checkpointing(copy.deepcopy(eager), checkpoint)  # wrappers around the blocks
    paths = apply_compile(model, CompileConfig(modules=["layers.*"], backend="aot_eager"))
    assert paths == ["layers.0", "layers.1", "layers.2", "layers.3"]  # the blocks, not their submodules
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()  # code compiled by an earlier test would be reused (the cache is per code object)
    before = _graphs()
    logits, grads = _forward_backward(model, tokens)
    assert _graphs() - before == 1  # 4 layers, one compiled graph
    _forward_backward(model, tokens)
    assert _graphs() - before == 1  # and no recompile on the next step
    ref_logits, ref_grads = _forward_backward(eager, tokens)
    assert torch.equal(logits, ref_logits)
    assert len(grads) == len(ref_grads)
    assert all(torch.equal(g / 2, r) for g, r in zip(grads, ref_grads))  # two backwards accumulated


def test_glob_selects_submodules_and_dead_glob_is_an_error():
    model = _model(n_layers=2)
    paths = apply_compile(model, CompileConfig(modules=["layers.*.attention", "layers.1.ffn_norm"],
                                               backend="aot_eager"))
    assert paths == ["layers.0.attention", "layers.1.attention", "layers.1.ffn_norm"]
    with pytest.raises(ConfigError, match=r"compile\.modules: 'blocks\.\*' matches no module"):
        apply_compile(_model(n_layers=2), CompileConfig(modules=["blocks.*"]))


def test_a_forward_wrapped_on_the_instance_is_refused_not_dropped():
    """activation_checkpoint.mode=regions replaces each block's forward on the instance; compiling the
    class's forward would silently undo it. Compiling twice is fine (our own wrapper is replaced)."""
    model = _model(n_layers=2)
    config = CompileConfig(modules=["layers.*"], backend="aot_eager")
    apply_compile(model, config)
    apply_compile(model, config)
    block = model.layers["1"]
    block.forward = lambda *args, **kwargs: type(block).forward(block, *args, **kwargs)
    with pytest.raises(ConfigError, match=r"compile\.modules: layers\.1's forward is already wrapped"):
        apply_compile(model, config)


def _debug(tmp_path, name, **compile_fields):
    cfg = get_recipe("debug").config()
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / name), steps=3)
    cfg.output = dataclasses.replace(cfg.output, progress=False, parity_check=False, sample_tokens=4,
                                     save_weights=False)
    cfg.validation = dataclasses.replace(cfg.validation, every=0)
    cfg.compile = CompileConfig(**compile_fields)
    return cfg


def test_trainer_with_compiled_blocks(tmp_path):
    """3 steps of the debug recipe with ``--compile.modules layers.*``: aot_eager gives eager's losses
    bitwise (so do the regions rmsnorm, swiglu, rope and loss); Inductor within 1e-5 absolute on losses ~8 (fused reductions in the norms and softmax
    grads reorder sums: measured 1e-6). The final greedy sample (no grad, a new length per token)
    takes the eager forward."""
    base = Trainer(_debug(tmp_path, "eager")).fit().losses
    assert Trainer(_debug(tmp_path, "aot", modules=["layers.*"], backend="aot_eager")).fit().losses == base
    with regions_enabled([]):  # the Trainer switches regions on for the process; restore after
        regions = ["rmsnorm", "swiglu", "rope", "loss"]
        assert Trainer(_debug(tmp_path, "regions", regions=regions, backend="aot_eager")).fit().losses == base
    inductor = Trainer(_debug(tmp_path, "inductor", modules=["layers.*"], backend="inductor")).fit().losses
    assert len(inductor) == len(base)
    assert max(abs(a - b) for a, b in zip(inductor, base)) <= 1e-5


def _cli_losses(run_dir, extra=(), env=None):
    cmd = [sys.executable, "-m", "lockstep.cli", "train", "--recipe", "debug", "--run-dir", str(run_dir),
           "--steps", "3", "--validation.every", "0", "--output.no-progress", "--output.sample-tokens", "0",
           "--output.no-save-weights", "--nproc", "2", "--parallel.dp-shard", "2", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r], proc.stderr


@pytest.mark.slow
def test_compiled_blocks_under_fsdp2_are_bitwise_with_aot_eager(tmp_path):
    """dp_shard=2 (FSDP2): the compiled inner forward runs between FSDP's eager all-gather and
    reshard hooks on the unsharded parameters; same layout, same kernels: bitwise losses. Each rank
    traces one graph for both blocks (dynamo's graph_code log)."""
    base, _ = _cli_losses(tmp_path / "eager")
    losses, log = _cli_losses(tmp_path / "compiled", ["--compile.modules", "layers.*", "--compile.backend", "aot_eager"],
                              env={"TORCH_LOGS": "graph_code"})
    assert losses == base and len(base) == 3
    assert log.count("TRACED GRAPH") == 2  # one per rank, not one per layer


def test_no_grad_and_graph_capture_run_the_plain_forward():
    """Evaluation, sampling and generation (no grad: new lengths every call) and a graph capture
    (which traces the plain forward itself) never reach the compiled code."""
    model = _model(n_layers=2)
    apply_compile(model, CompileConfig(modules=["layers.*"], backend="aot_eager"))
    tokens = torch.randint(0, 256, (2, 9))
    before = _graphs()
    with torch.no_grad():
        model(tokens)
    with capturing():
        model(tokens)
    assert _graphs() == before
