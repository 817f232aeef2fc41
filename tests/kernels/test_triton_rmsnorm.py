"""RMSNorm kernels against their torch references, and the references against transformers."""

import pytest
import torch
from kernel_cases import ON_CUDA, assert_close

from kernels import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
SHAPES = [(5, 96), (3, 576), (1, 64), (70, 64)]  # hidden sizes that are and are not powers of two; rows past a program
if ON_CUDA:
    SHAPES += [(4096, 576), (512, 4096)]


def _inputs(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> tuple:
    x = torch.randn(shape, device=device).to(dtype)
    residual = torch.randn(shape, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[1], device=device)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_rms_norm(device: torch.device, shape: tuple[int, int], dtype: torch.dtype) -> None:
    x, _, weight = _inputs(shape, dtype, device)
    out = torch.full_like(x, float("nan"))
    assert rms_norm(x, weight, 1e-5, out=out) is out
    assert_close(out, rms_norm_ref(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_fused_add_rms_norm(
    device: torch.device, shape: tuple[int, int], dtype: torch.dtype
) -> None:
    x, residual, weight = _inputs(shape, dtype, device)
    x_before, residual_before = x.clone(), residual.clone()
    out, residual_out = fused_add_rms_norm(x, residual, weight)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight)
    assert_close(out, expected_out)
    assert_close(residual_out, expected_residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_fused_add_rms_norm_inplace(device: torch.device) -> None:
    x, residual, weight = _inputs((4, 96), torch.bfloat16, device)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight)
    out, residual_out = fused_add_rms_norm(x, residual, weight, inplace=True)
    assert out is x and residual_out is residual
    assert_close(x, expected_out)
    assert_close(residual, expected_residual)


def test_strided_rows(device: torch.device) -> None:
    x, _, weight = _inputs((6, 96), torch.float16, device)
    wide = torch.randn(6, 200, device=device).to(torch.float16)
    wide[:, :96] = x
    assert_close(rms_norm(wide[:, :96], weight), rms_norm_ref(x, weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_references_match_transformers(dtype: torch.dtype) -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    x, residual, weight = _inputs((5, 96), dtype, torch.device("cpu"))
    norm = llama.LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        torch.testing.assert_close(rms_norm_ref(x, weight, 1e-5), norm(x), atol=0, rtol=0)
        out, residual_out = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
        torch.testing.assert_close(residual_out, x + residual, atol=0, rtol=0)
        torch.testing.assert_close(out, norm(x + residual), atol=0, rtol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        ("weight_len", "weight must have shape"),
        ("weight_dtype", "weight must have dtype"),
        ("x_3d", "x must have shape"),
        ("x_int", "x must have dtype"),
        ("residual_shape", "residual must have shape"),
        ("x_stride", "x must have a contiguous last dimension"),
    ],
)
def test_launcher_rejects_bad_inputs(device: torch.device, change: str, message: str) -> None:
    x, residual, weight = _inputs((4, 64), torch.float16, device)
    if change == "weight_len":
        weight = weight[:-1]
    elif change == "weight_dtype":
        weight = weight.float()
    elif change == "x_3d":
        x = x[None]
    elif change == "x_int":
        x = x.to(torch.int32)
    elif change == "residual_shape":
        residual = residual[:-1]
    elif change == "x_stride":
        x = torch.randn(4, 128, device=device).half()[:, ::2]
    with pytest.raises(ValueError, match=message):
        fused_add_rms_norm(x, residual, weight)
