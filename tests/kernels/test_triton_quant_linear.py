"""The quantized-weight linear kernel (fp8, int8, int4, with or without zero points) against
a dense product over the dequantized weight."""

import pytest
import torch
from kernel_cases import ON_CUDA, assert_close, cdiv
from torch.nn import functional as F

from kernels import quant_linear, quant_linear_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# (rows, N, K, scale block): a decode row with blocks off square; sizes off the tile grid with
# 128 x 128 blocks (a partial block each way); one scale per output channel; one per tensor
CASES = [(1, 96, 64, (16, 32)), (37, 200, 136, (128, 128)), (5, 64, 96, (1, 96)), (70, 48, 80, (48, 80))]
if ON_CUDA:
    CASES += [(1, 4096, 4096, (128, 128)), (512, 6144, 4096, (128, 128)), (16, 1024, 2048, (1, 2048))]


def quantize(dense: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's values over its largest magnitude, mapped onto e4m3's +-448."""
    n, k = dense.shape
    rows, cols = cdiv(n, block[0]), cdiv(k, block[1])
    padded = torch.zeros(rows * block[0], cols * block[1], device=dense.device)
    padded[:n, :k] = dense.float()
    tiles = padded.view(rows, block[0], cols, block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # [rows, cols]
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:n, :k].to(torch.float8_e4m3fn)
    return q, scale


def _inputs(case, dtype, device, bias=False):
    m, n, k, block = case
    x = torch.randn(m, k, device=device).to(dtype)
    weight, scale = quantize(torch.randn(n, k, device=device) * k**-0.5, block)
    return x, weight, scale, torch.randn(n, device=device).to(dtype) if bias else None


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_quant_linear_matches_the_dequantized_product(device: torch.device, case, dtype: torch.dtype) -> None:
    x, weight, scale, _ = _inputs(case, dtype, device)
    assert_close(quant_linear(x, weight, scale, case[3]), quant_linear_ref(x, weight, scale, case[3]))


def test_quant_linear_adds_the_bias_and_reads_strided_rows(device: torch.device) -> None:
    case = (6, 80, 64, (16, 32))
    x, weight, scale, bias = _inputs(case, torch.float32, device, bias=True)
    wide = torch.randn(6, 100, device=device)
    wide[:, 20:84] = x
    out = quant_linear(wide[:, 20:84], weight, scale, case[3], bias)
    assert_close(out, quant_linear_ref(x, weight, scale, case[3], bias))
    # the scales do bite: each block's own, not one for all
    assert not torch.allclose(out, quant_linear_ref(x, weight, scale.mean().expand_as(scale), case[3], bias))


def test_quant_linear_of_no_rows(device: torch.device) -> None:
    x, weight, scale, _ = _inputs((0, 32, 64, (16, 32)), torch.bfloat16, device)
    assert quant_linear(x, weight, scale, (16, 32)).shape == (0, 32)


def test_quant_linear_rejects_what_it_cannot_run(device: torch.device) -> None:
    x, weight, scale, _ = _inputs((3, 64, 64, (16, 32)), torch.float32, device)
    with pytest.raises(ValueError, match=r"weight must have dtype in \(float8_e4m3fn, int8, int32\)"):
        quant_linear(x, weight.float(), scale, (16, 32))
    with pytest.raises(ValueError, match=r"scale must have shape \[4, 2\]"):
        quant_linear(x, weight, scale[:, :1], (16, 32))
    with pytest.raises(ValueError, match="scale block of 24 columns"):
        quant_linear(x, weight, torch.ones(4, 3, device=device), (16, 24))
    with pytest.raises(ValueError, match=r"weight must have shape \[\*, 32\]"):
        quant_linear(x[:, :32], weight, scale, (16, 32))


def quantize_int(dense: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric integers of `bits` bits (int8 storage) with a scale per output row and group
    of `group` columns: each group's largest magnitude maps to 2^(bits-1) - 1."""
    n, k = dense.shape
    groups = dense.float().view(n, k // group, group)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / (2 ** (bits - 1) - 1)  # [n, k / group]
    q = (groups / scale[..., None]).round().clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return q.view(n, k).to(torch.int8), scale


# (rows, N, K, group): int8 per channel; int4 in groups of 32 and 128 (W4A16's), and per channel
INT_CASES = [(8, 1, 96, 64, 64), (4, 37, 80, 256, 32), (4, 1, 64, 256, 128), (4, 5, 48, 96, 96)]
if ON_CUDA:
    INT_CASES += [(4, 1, 4096, 4096, 128), (4, 512, 4096, 4096, 128), (8, 16, 4096, 4096, 4096)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", INT_CASES, ids=[f"int{c[0]} {c[1:]}" for c in INT_CASES])
def test_quant_linear_over_integer_weights(device: torch.device, case, dtype: torch.dtype) -> None:
    """int8 values, and int4 values packed as compressed-tensors packs them (its own packer
    writes them); the reference multiplies the unpacked integers."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    bits, m, n, k, group = case
    x = torch.randn(m, k, device=device).to(dtype)
    q, scale = quantize_int(torch.randn(n, k) * k**-0.5, bits, group)
    weight = pack_to_int32(q, 4) if bits == 4 else q
    assert weight.dtype == (torch.int32 if bits == 4 else torch.int8)
    weight, q, scale = weight.to(device), q.to(device), scale.to(device)
    out = quant_linear(x, weight, scale, (1, group))
    assert_close(out, quant_linear_ref(x, q, scale, (1, group)))


def asymmetric_int(n: int, k: int, bits: int, group: int, seed: int = 0):
    """GPTQ's and AWQ's integers: unsigned values [n, k], a zero point and a scale per row and
    group of `group` columns. Returns them as the kernel takes them (values and zero points
    less 2^(bits-1), int8; int4 packed by compressed-tensors' packer) and the dense weight
    (q - zero) * scale in float32, computed here from the unsigned integers."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=gen)
    zero = torch.randint(0, 2**bits, (n, cdiv(k, group)), generator=gen)
    scale = (torch.rand(n, cdiv(k, group), generator=gen) + 0.5) * k**-0.5 / 2 ** (bits - 1)  # |weights| ~ k^-1/2
    spread = lambda grid: grid.repeat_interleave(group, dim=1)[:, :k]  # noqa: E731
    dense = (q - spread(zero)).float() * spread(scale)
    mid = 2 ** (bits - 1)
    values = (q - mid).to(torch.int8)
    stored = pack_to_int32(values, 4) if bits == 4 else values
    return stored, scale, (zero - mid).to(torch.int8), dense


# (bits, rows, N, K, group): int4 in groups of 32 (AWQ's and GPTQ's grids), int8 per channel
ZERO_CASES = [(4, 37, 80, 256, 32), (8, 3, 48, 96, 96)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", ZERO_CASES, ids=[f"int{c[0]} {c[1:]}" for c in ZERO_CASES])
def test_quant_linear_subtracts_zero_points(device: torch.device, case, dtype: torch.dtype) -> None:
    """Asymmetric integers (GPTQ's, AWQ's): each value less its group's zero point, then
    scaled; against the dense product over that weight rounded to the activation dtype."""
    bits, m, n, k, group = case
    weight, scale, zero, dense = asymmetric_int(n, k, bits, group)
    x = torch.randn(m, k).to(dtype)
    out = quant_linear(x.to(device), weight.to(device), scale.to(device), (1, group), zero=zero.to(device))
    assert_close(out, F.linear(x.float(), dense.to(dtype).float()).to(dtype).to(device))
    without = quant_linear(x.to(device), weight.to(device), scale.to(device), (1, group))
    assert not torch.allclose(out.float(), without.float())  # the zero points do bite


def test_quant_linear_refuses_zero_points_it_cannot_read(device: torch.device) -> None:
    weight, scale, zero, _ = asymmetric_int(32, 64, 4, 32)
    x = torch.randn(2, 64, device=device)
    weight, scale, zero = weight.to(device), scale.to(device), zero.to(device)
    with pytest.raises(ValueError, match=r"zero must have the scales' shape \[32, 2\]"):
        quant_linear(x, weight, scale, (1, 32), zero=zero[:, :1])
    with pytest.raises(ValueError, match=r"zero must have dtype in \(int8\)"):
        quant_linear(x, weight, scale, (1, 32), zero=zero.float())
    fp8, fp8_scale = quantize(torch.randn(32, 64, device=device), (1, 32))
    with pytest.raises(ValueError, match="zero .zero points. goes with int8 or int4 weights"):
        quant_linear(x, fp8, fp8_scale, (1, 32), zero=zero)
