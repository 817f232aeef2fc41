"""reshape_and_cache against its torch reference and an independent per-token loop."""

import pytest
import torch
from kernel_cases import ON_CUDA

from kernels import reshape_and_cache, reshape_and_cache_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_tokens, num_blocks, block_size, num_kv_heads, head_dim)
SHAPES = [(7, 4, 4, 3, 64), (5, 3, 16, 1, 128), (12, 6, 8, 8, 16), (6, 3, 4, 3, 96)]  # 96: Phi-3
if ON_CUDA:
    SHAPES.append((4096, 2048, 16, 8, 128))


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple:
    num_tokens, num_blocks, block_size, num_kv_heads, head_dim = shape
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn_like(key)
    # Distinct random slots, every third token a padding token.
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::3] = -1
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), device=device).to(dtype)
    return key, value, k_cache, k_cache.clone(), slots


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_matches_reference(
    device: torch.device, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    key, value, k_cache, v_cache, slots = _inputs(shape, dtype, device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    # A copy is exact; NaN marks slots nobody may write, so compare with NaN == NaN.
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)


def test_reference_against_per_token_loop() -> None:
    key, value, k_cache, v_cache, slots = _inputs(SHAPES[0], torch.float32, torch.device("cpu"))
    reshape_and_cache_ref(key, value, k_cache, v_cache, slots)
    block_size = k_cache.shape[1]
    for tok, slot in enumerate(slots.tolist()):
        if slot == -1:
            continue
        assert torch.equal(k_cache[slot // block_size, slot % block_size], key[tok])
        assert torch.equal(v_cache[slot // block_size, slot % block_size], value[tok])
    written = (slots >= 0).sum().item()
    assert (~k_cache.isnan()).all(-1).all(-1).sum().item() == written  # nothing else touched


def test_padding_slots_skipped(device: torch.device) -> None:
    key, value, k_cache, v_cache, slots = _inputs(SHAPES[0], torch.float16, device)
    slots[:] = -1
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert k_cache.isnan().all() and v_cache.isnan().all()


def test_strided_key_value(device: torch.device) -> None:
    """K and V as views of a fused QKV projection output."""
    key, value, k_cache, v_cache, slots = _inputs(SHAPES[0], torch.float16, device)
    qkv = torch.randn(key.shape[0], 9, 64, device=device).to(torch.float16)  # q 3, k 3, v 3 heads
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache(qkv[:, 3:6], qkv[:, 6:], k_cache, v_cache, slots)
    reshape_and_cache_ref(qkv[:, 3:6], qkv[:, 6:], ref_k, ref_v, slots)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize(
    "change, message",
    [
        ("slots_int32", "slot_mapping must have dtype"),
        ("slots_short", "slot_mapping must have shape"),
        ("cache_dtype", "k_cache must have dtype"),
        ("cache_heads", "k_cache must have shape"),
        ("cache_strides", "v_cache must be contiguous"),
        ("value_shape", "value must have shape"),
        ("key_stride", "key must have a contiguous last dimension"),
    ],
)
def test_launcher_rejects_bad_inputs(device: torch.device, change: str, message: str) -> None:
    key, value, k_cache, v_cache, slots = _inputs(SHAPES[0], torch.float16, device)
    if change == "slots_int32":
        slots = slots.int()
    elif change == "slots_short":
        slots = slots[:-1]
    elif change == "cache_dtype":
        k_cache = k_cache.float()
    elif change == "cache_heads":
        k_cache = k_cache[:, :, :2]
    elif change == "cache_strides":
        v_cache = v_cache.transpose(0, 1).contiguous().transpose(0, 1)
    elif change == "value_shape":
        value = value[:, :2]
    elif change == "key_stride":
        key = torch.randn(key.shape[0], key.shape[1], 128, device=device).half()[..., ::2]
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(key, value, k_cache, v_cache, slots)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_fp8_cache_holds_the_values_clamped_and_rounded(device: torch.device, dtype: torch.dtype) -> None:
    """kv_cache_dtype="fp8": each value rounded to e4m3, those past its range clamped to
    +-448 (not turned into NaN); padding slots untouched."""
    key, value, _, _, slots = _inputs(SHAPES[0], dtype, device)
    key[1, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, 0.1])  # token 0 is padding
    k_cache = torch.zeros(4, 4, 3, 64, device=device).to(torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    written = slots >= 0
    for x, cache in ((key, k_cache), (value, v_cache)):
        stored = cache.view(-1, 3, 64)[slots[written]].float()
        expected = x[written].float().clamp(-448, 448).to(torch.float8_e4m3fn).float()
        assert torch.equal(stored, expected)
    assert k_cache.view(-1, 3, 64)[slots[1], 0, :4].float().tolist() == [448.0, -448.0, 448.0, 0.1015625]
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    assert torch.equal(ref_k.float(), k_cache.float()) and torch.equal(ref_v.float(), v_cache.float())
