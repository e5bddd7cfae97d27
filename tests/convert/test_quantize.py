"""lockstep's low-precision emulation (lockstep.convert.quantize) is torchao's math: the casts are
bitwise torchao's, and the emulated GEMMs match torchao's emulated linears."""

import pytest
import torch

from lockstep.convert.quantize import EmulatedLowPrecisionMM, fp8_qdq, mx_qdq



def _operand(rows=48, cols=96, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(rows, cols) * torch.logspace(-3, 3, cols)  # six decades: exercises per-row/block scales
    x[3] = 0  # an all-zero row: the amax floor
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_casts_are_torchaos(dtype):
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    x = _operand().to(dtype)
    for target, granularity, dim, pow2 in [
        (torch.float8_e4m3fn, ScalingGranularity.TENSORWISE, None, False),
        (torch.float8_e5m2, ScalingGranularity.TENSORWISE, None, False),
        (torch.float8_e4m3fn, ScalingGranularity.AXISWISE, 1, True),
        (torch.float8_e4m3fn, ScalingGranularity.AXISWISE, 0, True),
    ]:
        scale = tensor_to_scale(x, target, scaling_granularity=granularity, axiswise_dim=dim,
                                round_scales_to_power_of_2=pow2)
        expected = to_fp8_saturated(x.float() * scale, target).float() / scale
        assert torch.equal(fp8_qdq(x, dim, target, pow2), expected), (target, granularity, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_cast_is_torchaos(dtype):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    x = _operand().to(dtype)
    mx = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL, KernelPreference.EMULATED)
    assert torch.equal(mx_qdq(x, 1), mx.dequantize(torch.float32))


def test_mx_cast_pads_a_ragged_block_with_zeros():
    x = _operand(rows=8, cols=70)  # 70 = two blocks + 6
    padded = torch.nn.functional.pad(x, (0, 26))
    assert torch.equal(mx_qdq(x, 1), mx_qdq(padded, 1)[:, :70])
    assert torch.equal(mx_qdq(x.t(), 0), mx_qdq(x, 1).t())


def _torchao_reference(fmt, x, w):
    """torchao's emulated linear of ``fmt``: (output, grad input, grad weight) for a sum-of-outputs loss."""
    import dataclasses

    from lockstep.convert.linear import MXFP8TrainingLinear, float8_linear_class

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    if fmt == "mxfp8":
        lin.__class__ = MXFP8TrainingLinear
    else:
        from torchao.float8.config import Float8LinearConfig

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(fmt.removeprefix("fp8_")), emulate=True)
        lin = float8_linear_class().from_float(lin, config=config)
    x = x.clone().requires_grad_()
    out = lin(x)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out.detach(), x.grad, lin.weight.grad


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_rowwise", "mxfp8"])
def test_emulated_gemms_match_torchaos_emulated_linear(fmt):
    x, w = _operand(64, 96, seed=1) / 100, _operand(32, 96, seed=2) / 100
    expected = _torchao_reference(fmt, x, w)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = EmulatedLowPrecisionMM.apply(xs, ws, fmt)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    # Same quantised operands (bitwise, above); only the float32 GEMMs' summation order may differ
    # between torchao's emulated mm and ours: a few float32 ulps of each result.
    for got, want in zip((out.detach(), xs.grad, ws.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
