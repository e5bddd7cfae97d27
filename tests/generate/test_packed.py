"""``EngineConfig.pack_weights``: bf16 linears on prepacked weights (kernels "bf16" / "onednn").

What must hold: a oneDNN-packed layer gives exactly ``F.linear``'s bits on a contiguous input
(measured for decode and prefill row counts, with AMX and with oneDNN capped to AVX-512; the
docstring of lockstep.generate.packed claims it), so an engine with it generates the very tokens and
logprobs of one without; a C-packed one ("bf16") gives its kernel's bits at every ISA level this
CPU runs (AMX, vdpbf16ps, plain C; the kernels' own tests: tests/numerics/test_decode_linear.py)
and the same tokens; either packed copy follows in-place writes and replaced parameters; the layer
is an ordinary linear under autograd and in fp32, and batch-invariant mode's bf16 linear on a cached
pack; the state dict does not change; the compiled decode step traces the packed op; asking for
AMX where there is none is a config error; the layer table forgets dropped layers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lockstep import numerics
from lockstep.config.base import ConfigError
from lockstep.generate import Request, SamplingParams
from lockstep.generate.packed import PackedLinear, available, pack_linears
from lockstep.ops import decode_linear, isa

from .conftest import FAMILIES, engine_for, prompts, tiny_model

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN")
#: (kernel, ISA level): oneDNN, and the C kernel at every level this CPU runs
KERNELS = [("onednn", isa.level())] + [("bf16", level) for level in isa.runnable()]
IDS = ["onednn"] + [f"bf16-{level}" for level in isa.runnable()]


@pytest.fixture
def kernel(request):
    name, level = request.param
    with isa.forced(level):
        yield name


def _layer(k: int, n: int, bias: bool, seed: int = 0, kernel: str = "onednn") -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    pack_linears(layer, batch_hint=16, kernel=kernel)
    assert isinstance(layer, PackedLinear) and layer._pack_kernel == kernel
    return layer


def _expected(layer: nn.Linear, x: torch.Tensor, kernel: str) -> torch.Tensor:
    """What the layer's kernel gives on the layer's current weights, packed afresh."""
    if kernel == "onednn":
        return F.linear(x, layer.weight, layer.bias)
    bias = layer.bias.float() if layer.bias is not None else None
    return decode_linear.linear(x, decode_linear.pack(layer.weight), layer.out_features, bias)


@pytest.mark.parametrize("k,n", [(64, 96), (576, 1536), (1536, 576), (48, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bitwise_f_linear(k, n, bias):
    """On contiguous inputs. A transposed input is made contiguous first: F.linear hands oneDNN the
    transposed layout itself, another kernel, whose bits differ from F.linear's own on the
    contiguous copy (without AMX at 3-33 rows, with AMX at 33: measured), so the claim is F.linear of
    the contiguous input (ONEDNN_MAX_CPU_ISA below: the same check with oneDNN's non-AMX kernels)."""
    layer = _layer(k, n, bias)
    with torch.no_grad():
        for rows in (1, 3, 16, 17, 100):
            x = torch.randn(rows, k).to(torch.bfloat16)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)), rows
        x3 = torch.randn(2, 5, k).to(torch.bfloat16)  # leading dims
        assert torch.equal(layer(x3), F.linear(x3, layer.weight, layer.bias))
        for rows in (3, 7, 33):
            xt = torch.randn(k, rows).to(torch.bfloat16).t()  # a non-contiguous input
            assert torch.equal(layer(xt), F.linear(xt.contiguous(), layer.weight, layer.bias)), rows


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS, indirect=True)
def test_packed_copy_follows_writes_and_replacements(kernel):
    layer = _layer(64, 32, bias=True, kernel=kernel)
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.no_grad():
        first = layer(x)
        assert torch.equal(first, _expected(layer, x, kernel))
        layer.weight.mul_(-1)  # in place: the version counter moves
        assert torch.equal(layer(x), _expected(layer, x, kernel))
        assert not torch.equal(layer(x), first)
        layer.bias.add_(1)
        assert torch.equal(layer(x), _expected(layer, x, kernel))
        layer.weight = nn.Parameter(torch.randn(32, 64).to(torch.bfloat16))  # replaced: a new storage
        assert torch.equal(layer(x), _expected(layer, x, kernel))


@pytest.mark.parametrize("isa_level", isa.runnable(), indirect=True)
def test_kernel_choice_per_level_and_amx_refused_where_missing(isa_level):
    """auto: the C kernel where it beats oneDNN at decode rows (AMX; vdpbf16ps), oneDNN below; "amx"
    only at level amx; any bf16 shape packs for the C kernel (odd ones run vdpbf16ps or plain C)."""
    odd = _layer(64, 40, bias=False, kernel="bf16")  # 40 columns: not a whole AMX tile
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(odd(x), _expected(odd, x, "bf16"))
    assert decode_linear.kernel(torch.bfloat16, 40, 64) != "amx"
    model = tiny_model("llama3").to(torch.bfloat16)
    with pytest.raises(ConfigError, match="engine.linear_kernel"):
        engine_for(model, linear_kernel="fast")
    fast_c = isa_level == "amx" or (isa_level == "avx512" and "avx512_bf16" in isa.cpu_flags())
    assert {m._pack_kernel for m in engine_for(model, linear_kernel="auto")._packed} == {"bf16" if fast_c else "onednn"}
    if isa_level == "amx":
        assert {m._pack_kernel for m in engine_for(model, linear_kernel="amx")._packed} == {"bf16"}
    else:
        with pytest.raises(ConfigError, match="engine.linear_kernel: 'amx' needs"):
            engine_for(model, linear_kernel="amx")


@pytest.mark.parametrize("isa_level", isa.runnable(), indirect=True)
def test_autograd_fp32_and_batch_invariant_use_the_ordinary_linear(isa_level):
    from lockstep.ops.batch_invariant import linear

    layer = _layer(64, 32, bias=False)
    x = torch.randn(4, 64).to(torch.bfloat16).requires_grad_()
    layer(x).float().square().sum().backward()  # the packed op has no backward: this must not use it
    assert x.grad is not None and layer.weight.grad is not None
    assert not layer.is_packed  # never packed: no no-grad bf16 call yet
    for kernel in ("onednn", "bf16"):  # the mode's linear, on a cached pack (kept aside by a oneDNN layer)
        layer = _layer(64, 32, bias=True, kernel=kernel)
        with torch.no_grad(), numerics.batch_invariant():
            xb = x.detach()
            assert torch.equal(layer(xb), linear(xb, layer.weight, layer.bias))
            assert torch.equal(layer(xb[1:3]), linear(xb, layer.weight, layer.bias)[1:3])
            layer.weight.mul_(-1)  # the mode's pack follows writes too
            assert torch.equal(layer(xb), linear(xb, layer.weight, layer.bias))
        assert list(layer._packs) == ([("bi", layer._pack_handle)] if kernel == "onednn" else [layer._pack_key])
    assert set(layer.state_dict()) == {"weight", "bias"}
    fp32 = _layer(64, 32, bias=False).float()
    xf = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(fp32(xf), F.linear(xf, fp32.weight))
    assert not fp32.is_packed


#: every family with oneDNN and the top level's C kernel; one family at the lower levels (the kernels'
#: own tests cover their arithmetic at every level)
ENGINE_CASES = [pytest.param(family, case, id=f"{family}-{name}") for family in FAMILIES
                for case, name in zip(KERNELS, IDS) if family == "llama3" or name in ("onednn", IDS[-1])]


@pytest.mark.parametrize("family,kernel", ENGINE_CASES, indirect=["kernel"])
def test_engine_with_packed_weights_generates_what_it_generates_without(family, kernel, monkeypatch):
    model = tiny_model(family).to(torch.bfloat16)
    reqs = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=6, temperature=0.7, seed=i))
            for i, p in enumerate(prompts([3, 9, 5]))]
    plain = engine_for(model, max_batch_size=4, pack_weights=False).generate(reqs)
    keys = set(model.state_dict())
    # the C kernel at every level (auto would pick oneDNN below vdpbf16ps, where it is faster)
    monkeypatch.setattr("lockstep.generate.engine.linear_kernel", lambda choice, dtype: kernel)
    engine = engine_for(model, max_batch_size=4)
    packed = [m for m in engine.runner.modules() if isinstance(m, PackedLinear)]
    assert packed and set(model.state_dict()) == keys
    results = engine.generate(reqs)
    used = [m.is_packed for m in packed]
    # every linear of a dense model runs packed; MoE routers compute their scores in fp32 themselves
    assert all(used) if family in ("llama3", "qwen3") else any(used)
    if kernel == "onednn":  # F.linear's bits: the very same run
        assert [(r.token_ids, r.logprobs) for r in results] == [(r.token_ids, r.logprobs) for r in plain]
        return
    assert any(m._pack_kernel == "bf16" for m in packed)
    # another summation order: logprobs within bf16 noise of these K <= 192 models while the two runs
    # draw the same tokens (the logits are bf16: a last-place change moves a logprob of ~5 by up to
    # 2^-7 of it); a draw at a near-tie may flip (then the sequences part): most do not
    shared = 0
    for ours, theirs in zip(results, plain):
        same = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b), 6)
        shared += same
        torch.testing.assert_close(torch.tensor(ours.logprobs[:same]), torch.tensor(theirs.logprobs[:same]),
                                   rtol=2**-7, atol=2e-2)
    assert shared >= 14, shared  # of 18 tokens


def test_packed_engine_follows_weight_updates_and_compiles():
    model = tiny_model("llama3")
    reqs = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=5, temperature=0)) for p in prompts([4, 6])]
    eager = engine_for(model, max_batch_size=2, weights_dtype="bfloat16", pack_weights=False)
    packed = engine_for(model, max_batch_size=2, weights_dtype="bfloat16", compile_decode="aot_eager")
    assert [r.token_ids for r in packed.generate(reqs)] == [r.token_ids for r in eager.generate(reqs)]
    with torch.no_grad():  # an RL-style in-place update of the fp32 source
        model.layers["0"].feed_forward.w2.weight.mul_(-2.0)
    after, again = eager.generate(reqs), packed.generate(reqs)
    assert [r.token_ids for r in again] == [r.token_ids for r in after]
    torch.testing.assert_close(torch.tensor([r.logprobs for r in again]), torch.tensor([r.logprobs for r in after]),
                               rtol=0, atol=0.05)  # bf16 logprobs; the compiled step pads the context


def test_sibling_grouping_pass_fuses_linears_that_share_an_input():
    """The Inductor pass the compiled step uses, on a traced graph: q/k/v-like siblings become one
    concatenated product and a split, with the same values (one wider oneDNN product: bitwise here)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lockstep.generate.packed import sibling_grouping_pass

    torch.manual_seed(0)
    q, k, v, other = (_layer(64, n, bias=b) for n, b in ((64, False), (32, True), (32, False), (48, False)))

    def op(layer, t):  # what the compiled step traces for each packed layer
        return torch.ops.lockstep.packed_linear(t, layer._pack_handle)

    def block(x, y):
        return op(q, x) * 2, op(k, x) + op(v, x), op(other, y)  # `other` reads another input: left alone

    x, y = torch.randn(3, 64).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        expected = block(x, y)
        gm = make_fx(block)(x, y)
        targets = lambda: [n.target for n in gm.graph.nodes if n.op == "call_function"]  # noqa: E731
        assert targets().count(torch.ops.lockstep.packed_linear.default) == 4
        sibling_grouping_pass()(gm.graph)  # what Inductor calls
        gm.recompile()
        assert targets().count(torch.ops.lockstep.packed_linear.default) == 1
        assert targets().count(torch.ops.lockstep.packed_linear_cat.default) == 1
        got = gm(x, y)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        k.weight.mul_(0.5)  # a write to one part repacks the group
        assert torch.equal(gm(x, y)[1], k(x) + v(x))
        k.bias.add_(1.0)  # so does a write to a part's bias
        assert torch.equal(gm(x, y)[1], F.linear(x, k.weight, k.bias) + F.linear(x, v.weight))


def test_fsdp_sharded_models_are_not_packed(tmp_path):
    """FSDP2 re-gathers weights into one storage without moving version counters: no packing there."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lockstep.generate.packed import packable

    model = tiny_model("llama3").to(torch.bfloat16)
    assert packable(model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert not packable(model)
        engine = engine_for(model, max_batch_size=2)
        assert not any(isinstance(m, PackedLinear) for m in model.modules()) and not engine._packed
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not decode_linear.available(torch.float32), reason="no AVX-512 fp32 kernel here")
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_engine_packs_for_the_avx512_kernel(family):
    """fp32 weights run on the fp32 kernel (another summation order than F.linear: the same greedy
    tokens, logprobs within 1e-5 at these K <= 192: fp32 sums of ~100 terms)."""
    model = tiny_model(family)
    reqs = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=6, temperature=0)) for p in prompts([3, 9, 5])]
    plain = engine_for(model, max_batch_size=4, pack_weights=False).generate(reqs)
    engine = engine_for(model, max_batch_size=4)
    results = engine.generate(reqs)
    assert engine._packed and any(m._pack_kernel == "f32" and m.is_packed for m in engine._packed)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    for ours, theirs in zip(results, plain):
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), rtol=0, atol=1e-5)
    assert not engine_for(tiny_model(family), linear_kernel="onednn")._packed  # fp32: the kernel or nothing


@pytest.mark.skipif(not decode_linear.available(torch.float32), reason="no AVX-512 fp32 kernel here")
def test_long_prefills_take_the_library_gemm(monkeypatch):
    from lockstep.generate.packed import PLAIN_ROWS

    torch.manual_seed(0)
    layer = nn.Linear(64, 48)
    pack_linears(layer, batch_hint=16, kernel="f32")
    calls = []
    kernel = decode_linear.linear
    monkeypatch.setattr(decode_linear, "linear", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    with torch.no_grad():
        short, long = torch.randn(PLAIN_ROWS, 64), torch.randn(PLAIN_ROWS + 1, 64)
        assert torch.equal(layer(long), F.linear(long, layer.weight, layer.bias))
        assert calls == []  # the library GEMM, not the kernel
        expected = kernel(short, decode_linear.pack(layer.weight), 48, layer.bias.float())
        assert torch.equal(layer(short), expected) and calls == [PLAIN_ROWS]


def test_the_layer_table_forgets_dropped_layers():
    """Handles are never reused, and a layer that is collected leaves the table (with its packs)."""
    import gc

    from lockstep.generate import packed

    layers = [_layer(64, 32, bias=False) for _ in range(3)]
    handles = [layer._pack_handle for layer in layers]
    assert len(set(handles)) == 3 and all(packed._LAYERS[h] is layer for h, layer in zip(handles, layers))
    with torch.no_grad():
        layers[1](torch.randn(2, 64).to(torch.bfloat16))
    del layers[1]
    gc.collect()
    assert handles[1] not in packed._LAYERS and handles[0] in packed._LAYERS and handles[2] in packed._LAYERS
    assert _layer(64, 32, bias=False)._pack_handle > max(handles)


@pytest.mark.slow
def test_bitwise_claim_with_onednn_capped_below_amx():
    """oneDNN's own dispatch capped to AVX512_CORE_BF16 (before torch loads; it then names
    brg_matmul:avx512_core_bf16 in its verbose log: checked when this test was written) reproduces
    a non-AMX CPU's bf16 GEMMs on an AMX one: the oneDNN-packed layer's claim must hold there too
    (on a CPU without AMX the caps change nothing: this repeats the main run's check)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "LOCKSTEP_CPU_ISA": "avx512"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                             f"{__file__}::test_packed_linear_is_bitwise_f_linear",
                             f"{__file__}::test_engine_with_packed_weights_generates_what_it_generates_without",
                             "-k", "bitwise or llama3-onednn"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_a_copy_of_a_packed_model_is_packed_as_its_own():
    """An fp32 engine packs the model's own layers; a bf16 engine's shadow deep-copies them: the
    copies get their own handles, kernel and packs (not the fp32 originals')."""
    import copy

    from lockstep.generate import packed

    model = nn.Sequential(nn.Linear(64, 32))
    pack_linears(model, batch_hint=4, kernel="onednn")
    shadow = copy.deepcopy(model).to(torch.bfloat16)
    [layer] = pack_linears(shadow, batch_hint=4, kernel="bf16")
    assert layer is shadow[0] and layer._pack_kernel == "bf16" and not layer._packs
    assert layer._pack_handle != model[0]._pack_handle and packed._LAYERS[layer._pack_handle] is layer
    assert pack_linears(shadow, batch_hint=4, kernel="bf16")[0]._pack_handle == layer._pack_handle  # once


def _cpp_served() -> bool:
    from lockstep.generate import packed

    return packed._serve_ops()


@pytest.mark.skipif(not decode_linear.available(), reason="no C compiler: the C kernels' packs do not exist")
def test_cpp_kernels_give_the_python_kernels_bits_and_follow_the_weights():
    """Where the C++ op library builds it serves the ops: the Python kernel's very bits (it calls the
    same C function) at every level this CPU runs and in fp32, for one layer and a sibling group, any
    row count and layout; its table follows in-place writes, ``.data =``, a replaced (and freed)
    parameter, ``drop_packed`` and collected layers."""
    import gc

    from lockstep.generate import packed

    if not _cpp_served():
        pytest.skip("the C++ op library did not build here")
    entries = torch.ops.lockstep._packed_entries
    cases = [(level, torch.bfloat16) for level in isa.runnable()]
    cases += [(isa.level(), torch.float32)] if decode_linear.available(torch.float32) else []
    for level, dtype in cases:
        with isa.forced(level), torch.no_grad():
            torch.manual_seed(0)
            kernel = "f32" if dtype == torch.float32 else "bf16"
            q, k, v = (nn.Linear(64, n, bias=b).to(dtype) for n, b in ((64, True), (32, False), (48, True)))
            pack_linears(nn.ModuleList([q, k, v]), batch_hint=16, kernel=kernel)
            group = [q._pack_handle, k._pack_handle, v._pack_handle]
            # earlier tests' packed layers still awaiting collection would leave the table during the
            # counts below (a collection triggered by these allocations): collect them first
            gc.collect()
            before = entries()
            for x in (torch.randn(1, 64), torch.randn(16, 64), torch.randn(2, 5, 64), torch.randn(64, 3).t()):
                x = x.to(dtype)
                for layer in (q, k, v):
                    got = torch.ops.lockstep.packed_linear(x, layer._pack_handle)
                    assert torch.equal(got, packed.packed_linear(x, layer._pack_handle)), (level, dtype)
                    assert torch.equal(layer(x), got)  # the eager forward takes the op too
                cat = torch.ops.lockstep.packed_linear_cat(x, group)
                assert torch.equal(cat, packed.packed_linear_cat(x, group))
            assert entries() == before + 4  # three layers and the group, registered once
            x = torch.randn(4, 64).to(dtype)
            for write in (lambda: q.weight.mul_(-1), lambda: q.bias.add_(1),
                          lambda: setattr(q.weight, "data", torch.randn(64, 64).to(dtype)),
                          lambda: setattr(q, "weight", nn.Parameter(torch.randn(64, 64).to(dtype)))):
                write()
                assert torch.equal(q(x), _expected(q, x, "bf16" if dtype == torch.bfloat16 else "f32"))
                cat = torch.ops.lockstep.packed_linear_cat(x, group)
                assert torch.equal(cat[:, :64], q(x)) and torch.equal(cat[:, 64:96], k(x))
            q.drop_packed()  # forgets q's entry and the group's
            assert entries() == before + 2
            del k
            gc.collect()
            assert entries() == before + 1
            del q, v, layer
            gc.collect()
            assert entries() == before


@pytest.mark.slow
@pytest.mark.skipif(not decode_linear.available(), reason="no C compiler: the C kernels' packs do not exist")
def test_python_kernels_serve_the_ops_without_the_cpp_library():
    """``$LOCKSTEP_NO_CPP_OPS``: the ops run their Python kernels, with the same bits (a fresh process:
    the kernels are registered once per process)."""
    import subprocess
    import sys

    script = """
import torch
from torch import nn
from lockstep.generate import packed
from lockstep.ops import decode_linear
torch.manual_seed(0)
a, b = nn.Linear(64, 32).to(torch.bfloat16), nn.Linear(64, 16, bias=False).to(torch.bfloat16)
packed.pack_linears(nn.ModuleList([a, b]), batch_hint=4, kernel="bf16")
assert not packed._CPP_KERNELS
x = torch.randn(3, 64).to(torch.bfloat16)
with torch.no_grad():
    want = decode_linear.linear(x, decode_linear.pack(a.weight), 32, a.bias.float())
    assert torch.equal(torch.ops.lockstep.packed_linear(x, a._pack_handle), want) and torch.equal(a(x), want)
    cat = torch.ops.lockstep.packed_linear_cat(x, [a._pack_handle, b._pack_handle])
    assert torch.equal(cat[:, :32], want) and torch.equal(cat[:, 32:], b(x))
    a.weight.mul_(2)
    assert torch.equal(a(x), decode_linear.linear(x, decode_linear.pack(a.weight), 32, a.bias.float()))
print("ok")
"""
    import os

    env = {**os.environ, "LOCKSTEP_NO_CPP_OPS": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr[-3000:]


def test_a_deep_copy_runs_its_own_weights_before_it_is_packed():
    """A deep copy carries the original's handle: until pack_linears gives it its own, its eager
    forward must run its own (copied, then changed) weights, not the handle's."""
    import copy

    layer = _layer(64, 32, bias=True, kernel="bf16")
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        layer(x)  # the original packed (and, with the C++ kernels, in their table)
        twin = copy.deepcopy(layer)
        twin.weight.mul_(-1)
        assert torch.equal(twin(x), _expected(twin, x, "bf16")) and torch.equal(layer(x), _expected(layer, x, "bf16"))
