"""local_compile: each named region compiled alone equals eager (bitwise with aot_eager, within a
stated tolerance with Inductor), runs plain while disabled or while a graph capture traces, and the
config refuses unknown and batch-invariant-unsafe regions naming the fields."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from lockstep.cli import resolve_config
from lockstep.compile.config import CompileConfig
from lockstep.compile.local import enabled_regions, known_regions, regions_enabled
from lockstep.config.base import ConfigError
from lockstep.graph.state import capturing
from lockstep.models.common.gated_deltanet import gated_deltanet_gate
from lockstep.models.common.mlp import swiglu_activation
from lockstep.models.common.moe_routing import route
from lockstep.models.common.norm import rms_norm, zero_centered_rms_norm
from lockstep.models.common.rope import apply_rotary
from lockstep.run.objective import lm_loss

pytestmark = pytest.mark.xdist_group("compile")


def _cases():
    """region name, the declared function, inputs (float leaves get grads), kwargs. Odd sizes (7, 13):
    vector loops have scalar tails."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return [
        ("rmsnorm", rms_norm, (r(2, 7, 13), r(13) + 1), {"eps": 1e-6}),
        ("rmsnorm", zero_centered_rms_norm, (r(2, 7, 13), r(13) * 0.1), {"eps": 1e-6}),
        ("swiglu", swiglu_activation, (r(2, 7, 13), r(2, 7, 13)), {}),
        ("rope", apply_rotary, (r(2, 3, 7, 10), r(1, 7, 10), r(1, 7, 10)), {}),
        ("loss", lm_loss, (r(2, 7, 13), torch.randint(0, 13, (2, 7), generator=g)), {}),
        ("moe_router", route, (r(14, 8),), {"top_k": 2, "score_func": "sigmoid", "n_group": 2, "topk_group": 1,
                                            "bias": r(8) * 0.01}),
        ("moe_router", route, (r(14, 8),), {"top_k": 2, "score_func": "softmax"}),
        ("gated_deltanet_gate", gated_deltanet_gate, (r(2, 7, 3), r(2, 7, 3), r(3), r(3)), {}),
    ]


CASES = _cases()
IDS = [f"{name}-{fn.__name__}-{i}" for i, (name, fn, _, _) in enumerate(CASES)]


def _run(fn, args, kwargs):
    """Outputs (float tensors) and the grads of their sum of squares w.r.t. every float input."""
    leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    out = fn(*leaves, **kwargs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.is_floating_point()]
    torch.autograd.backward(sum(o.float().pow(2).sum() for o in outs))
    return outs, [a.grad for a in leaves if a.is_floating_point()]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_every_declared_region_is_tested():
    assert {name for name, *_ in CASES} == set(known_regions())
    assert enabled_regions() == []


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_aot_eager_region_is_bitwise_eager(case):
    """aot_eager runs the ATen kernels eager runs: forward and grads bitwise."""
    name, fn, args, kwargs = case
    eager_out, eager_grads = _run(fn, args, kwargs)
    before = _graphs()
    with regions_enabled([name], "aot_eager"):
        out, grads = _run(fn, args, kwargs)
    assert _graphs() > before  # the compiled path ran
    assert all(torch.equal(a, b) for a, b in zip(out, eager_out, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads, strict=True))


FIRST_PER_REGION = {}  # Inductor compiles are slow on this CPU: one function per region
for _case, _id in zip(CASES, IDS):
    FIRST_PER_REGION.setdefault(_case[0], (_case, _id))


@pytest.mark.parametrize("case", [c for c, _ in FIRST_PER_REGION.values()], ids=[i for _, i in FIRST_PER_REGION.values()])
def test_inductor_region_is_close_to_eager(case):
    """Inductor fuses each region into generated loops: reductions (rms, logsumexp, softmax, the
    grads' sums over broadcast dims) add in another order and elementwise chains stay in registers,
    so fp32 values move by a few ulp. Measured: at most 5e-6 relative (swiglu's grads; rmsnorm 2e-6)
    on values up to ~140; the bound 1e-5 relative + 1e-5 absolute is far below what a wrong formula moves."""
    name, fn, args, kwargs = case
    eager_out, eager_grads = _run(fn, args, kwargs)
    torch._dynamo.reset()  # count this test's compile only
    before = _graphs()
    with regions_enabled([name], "inductor"):
        out, grads = _run(fn, args, kwargs)
    assert _graphs() > before
    for a, b in zip(out + grads, eager_out + eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_batch_invariant_under_inductor(dtype):
    """rope is declared batch-invariant: each output element is the same arithmetic wherever it sits,
    so a sequence's rotation does not depend on the batch around it (nor the head count / length tail)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 7, 10, generator=g).to(dtype)
    cos, sin = torch.randn(3, 7, 10, generator=g), torch.randn(3, 7, 10, generator=g)
    with regions_enabled(["rope"], "inductor"):
        whole = apply_rotary(x, cos, sin)
        for i in range(3):
            assert torch.equal(apply_rotary(x[i:i + 1], cos[i:i + 1], sin[i:i + 1]), whole[i:i + 1])
    if dtype == torch.float32:  # no rounding between the products and the sum: eager's bits too
        assert torch.equal(whole, apply_rotary(x, cos, sin))


def test_disabled_and_capturing_regions_run_the_plain_function():
    x, w = torch.randn(2, 5, 8), torch.ones(8)
    before = _graphs()
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm.__wrapped__(x, w, 1e-6))
    with regions_enabled(["rmsnorm"], "aot_eager"), capturing():
        rms_norm(x, w, 1e-6)
    assert _graphs() == before
    assert enabled_regions() == []  # regions_enabled restored the previous (empty) set


def test_unknown_region_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"compile\.regions: unknown compile region 'rmsnrom'.*rmsnorm"):
        CompileConfig(regions=["rmsnrom"]).validate("compile")
    with pytest.raises(ConfigError, match="compile.backend"):
        CompileConfig(backend="eager").validate("compile")


def test_batch_invariant_unsafe_region_is_refused_naming_both_fields():
    base = ["--recipe", "debug", "--numerics.batch-invariant", "--training.device", "cpu"]
    with pytest.raises(ConfigError, match=r"compile\.regions.*\['swiglu'\].*numerics\.batch_invariant"):
        resolve_config(base + ["--compile.regions", "rope", "swiglu"])
    with pytest.raises(ConfigError, match=r"compile\.modules.*numerics\.batch_invariant"):
        resolve_config(base + ["--compile.modules", "layers.*"])
    cfg, _ = resolve_config(base + ["--compile.regions", "rope"])  # declared batch-invariant
    assert cfg.compile.regions == ["rope"]
    unsafe = sorted(n for n, r in known_regions().items() if not r.batch_invariant)
    assert unsafe == ["gated_deltanet_gate", "loss", "moe_router", "rmsnorm", "swiglu"]


def test_cli_takes_regions_modules_and_backend():
    cfg, _ = resolve_config(["--recipe", "debug", "--compile.regions", "rmsnorm", "swiglu",
                             "--compile.modules", "layers.*", "--compile.backend", "aot_eager"])
    assert cfg.compile == CompileConfig(regions=["rmsnorm", "swiglu"], modules=["layers.*"], backend="aot_eager")
    assert dataclasses.asdict(resolve_config(["--recipe", "debug"])[0].compile)["regions"] == []
