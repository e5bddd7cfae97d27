"""``EngineConfig.pack_weights``: bf16 linears on prepacked weights (``linear_kernel`` amx / onednn).

What must hold: a oneDNN-packed layer gives exactly ``F.linear``'s bits (measured on this CPU for
decode and prefill row counts; the docstring of lockstep.generate.packed claims it), so an engine
with it generates the very tokens and logprobs of one without; an AMX-packed one gives the AMX
kernel's bits (its own tests: tests/numerics/test_decode_linear.py) and the same tokens; either packed
copy follows in-place writes and replaced parameters; the layer is an ordinary linear under
autograd, in batch-invariant mode and in fp32; the state dict does not change; the compiled decode
step traces the packed op; asking for AMX where there is none is a config error.
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
from lockstep.ops import decode_linear

from .conftest import FAMILIES, engine_for, prompts, tiny_model

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN")
KERNELS = ["onednn", pytest.param("amx", marks=pytest.mark.skipif(not decode_linear.available(), reason="no AMX here"))]


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
    layer = _layer(k, n, bias)
    with torch.no_grad():
        for rows in (1, 3, 16, 17, 100):
            x = torch.randn(rows, k).to(torch.bfloat16)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)), rows
        x3 = torch.randn(2, 5, k).to(torch.bfloat16)  # leading dims and a non-contiguous input
        assert torch.equal(layer(x3), F.linear(x3, layer.weight, layer.bias))
        xt = torch.randn(k, 7).to(torch.bfloat16).t()
        assert torch.equal(layer(xt), F.linear(xt, layer.weight, layer.bias))


@pytest.mark.parametrize("kernel", KERNELS)
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


def test_amx_falls_back_per_layer_and_is_refused_where_missing(monkeypatch):
    odd = _layer(64, 40, bias=False, kernel="onednn")  # 40 columns: not a whole AMX tile
    pack_linears(odd, batch_hint=16, kernel="amx")
    assert odd._pack_kernel == "onednn"
    model = tiny_model("llama3").to(torch.bfloat16)
    with pytest.raises(ConfigError, match="engine.linear_kernel"):
        engine_for(model, linear_kernel="fast")
    monkeypatch.setattr(decode_linear, "available", lambda dtype=torch.bfloat16: False)
    with pytest.raises(ConfigError, match="engine.linear_kernel: 'amx' needs"):
        engine_for(model, linear_kernel="amx")
    assert {m._pack_kernel for m in engine_for(model, linear_kernel="auto")._packed} == {"onednn"}


def test_autograd_fp32_and_batch_invariant_use_the_ordinary_linear():
    layer = _layer(64, 32, bias=False)
    x = torch.randn(4, 64).to(torch.bfloat16).requires_grad_()
    layer(x).float().square().sum().backward()  # the packed op has no backward: this must not use it
    assert x.grad is not None and layer.weight.grad is not None
    assert not layer.is_packed  # never packed: no no-grad bf16 call yet
    with torch.no_grad(), numerics.batch_invariant():
        from lockstep.ops.batch_invariant import linear

        xb = x.detach()
        assert torch.equal(layer(xb), linear(xb, layer.weight))
    assert not layer.is_packed
    assert set(layer.state_dict()) == {"weight"}
    fp32 = _layer(64, 32, bias=False).float()
    xf = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(fp32(xf), F.linear(xf, fp32.weight))
    assert not fp32.is_packed


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_with_packed_weights_generates_what_it_generates_without(family, kernel):
    model = tiny_model(family).to(torch.bfloat16)
    reqs = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=6, temperature=0.7, seed=i))
            for i, p in enumerate(prompts([3, 9, 5]))]
    plain = engine_for(model, max_batch_size=4, pack_weights=False).generate(reqs)
    keys = set(model.state_dict())
    engine = engine_for(model, max_batch_size=4, linear_kernel=kernel)
    packed = [m for m in engine.runner.modules() if isinstance(m, PackedLinear)]
    assert packed and set(model.state_dict()) == keys
    results = engine.generate(reqs)
    used = [m.is_packed for m in packed]
    # every linear of a dense model runs packed; MoE routers compute their scores in fp32 themselves
    assert all(used) if family in ("llama3", "qwen3") else any(used)
    if kernel == "onednn":  # F.linear's bits: the very same run
        assert [(r.token_ids, r.logprobs) for r in results] == [(r.token_ids, r.logprobs) for r in plain]
        return
    assert any(m._pack_kernel == "amx" for m in packed)
    # another summation order: the same draws, logprobs within bf16 noise of these K <= 192 models
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    for ours, theirs in zip(results, plain):
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), rtol=0, atol=2e-2)


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
