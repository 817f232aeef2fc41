"""Rotary embedding kernel against its torch reference, and the reference against transformers."""

import pytest
import torch
from kernel_cases import ON_CUDA, assert_close

from kernels import apply_rotary_emb, apply_rotary_emb_ref, build_cos_sin_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# (num_tokens, num_heads, num_kv_heads, head_dim)
SHAPES = [(6, 9, 3, 64), (3, 4, 4, 128), (5, 8, 2, 16), (4, 6, 2, 96), (70, 4, 2, 16)]  # 96: Phi-3's heads; 70: past a program
if ON_CUDA:
    SHAPES += [(4096, 32, 8, 128), (4096, 9, 3, 64)]
MAX_POSITION = 4096


def _cache(head_dim: int, device: torch.device) -> torch.Tensor:  # [MAX_POSITION, head_dim]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return build_cos_sin_cache(inv_freq.to(device), MAX_POSITION)


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple:
    num_tokens, num_heads, num_kv_heads, head_dim = shape
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device=device)
    q = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    return positions, q, k, _cache(head_dim, device)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_matches_reference(
    device: torch.device, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    positions, q, k, cos_sin = _inputs(shape, dtype, device)
    expected_q, expected_k = apply_rotary_emb_ref(positions, q, k, cos_sin)
    apply_rotary_emb(positions, q, k, cos_sin)
    assert_close(q, expected_q)
    assert_close(k, expected_k)


def test_int32_positions_and_strided_views(device: torch.device) -> None:
    """q and k as views of one fused QKV output, rotated in place; v untouched."""
    positions, _, _, cos_sin = _inputs((4, 6, 2, 64), torch.float16, device)
    qkv = torch.randn(4, 10, 64, device=device).to(torch.float16)  # q 6, k 2, v 2 heads
    before = qkv.clone()
    expected_q, expected_k = apply_rotary_emb_ref(positions, qkv[:, :6], qkv[:, 6:8], cos_sin)
    apply_rotary_emb(positions.int(), qkv[:, :6], qkv[:, 6:8], cos_sin)
    assert_close(qkv[:, :6], expected_q)
    assert_close(qkv[:, 6:8], expected_k)
    assert torch.equal(qkv[:, 8:], before[:, 8:])


def test_partial_rotary_rotates_the_leading_columns_only(device: torch.device) -> None:
    """Phi-4-mini: 96 of each 128-wide head rotated, from a 96-wide table; the rest untouched."""
    positions, _, _, cos_sin = _inputs((5, 6, 2, 96), torch.bfloat16, device)
    qk = torch.randn(5, 8, 128, device=device).to(torch.bfloat16)
    before = qk.clone()
    expected_q, expected_k = apply_rotary_emb_ref(positions, qk[:, :6, :96], qk[:, 6:, :96], cos_sin)
    apply_rotary_emb(positions, qk[:, :6, :96], qk[:, 6:, :96], cos_sin)
    assert_close(qk[:, :6, :96], expected_q)
    assert_close(qk[:, 6:, :96], expected_k)
    assert torch.equal(qk[..., 96:], before[..., 96:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_transformers(dtype: torch.dtype) -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=9 * 64, num_attention_heads=9, num_key_value_heads=3,
                         rope_theta=100000.0, max_position_embeddings=MAX_POSITION)  # fmt: skip
    rotary = llama.LlamaRotaryEmbedding(config=config)
    positions = torch.randint(0, MAX_POSITION, (7,))
    q = torch.randn(7, 9, 64).to(dtype)
    k = torch.randn(7, 3, 64).to(dtype)
    cos, sin = rotary(q, positions[None])  # [1, 7, 64] each
    hf_q, hf_k = llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                            cos, sin)  # fmt: skip
    cos_sin = build_cos_sin_cache(rotary.inv_freq, MAX_POSITION, rotary.attention_scaling)
    ref_q, ref_k = apply_rotary_emb_ref(positions, q, k, cos_sin)
    # HF rounds each product to the dtype; the reference rounds once.
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (3e-2, 2e-2)
    torch.testing.assert_close(ref_q, hf_q[0].transpose(0, 1), atol=atol, rtol=rtol)
    torch.testing.assert_close(ref_k, hf_k[0].transpose(0, 1), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "change, message",
    [
        ("cache_dtype", "cos_sin_cache must have dtype"),
        ("cache_width", "cos_sin_cache must have shape"),
        ("positions_float", "positions must have dtype"),
        ("positions_len", "positions must have shape"),
        ("k_head_dim", "k must have shape"),
        ("k_dtype", "k must have dtype"),
        ("q_stride", "q must have a contiguous last dimension"),
    ],
)
def test_launcher_rejects_bad_inputs(device: torch.device, change: str, message: str) -> None:
    positions, q, k, cos_sin = _inputs(SHAPES[0], torch.float16, device)
    if change == "cache_dtype":
        cos_sin = cos_sin.half()
    elif change == "cache_width":
        cos_sin = cos_sin[:, :32]
    elif change == "positions_float":
        positions = positions.float()
    elif change == "positions_len":
        positions = positions[:-1]
    elif change == "k_head_dim":
        k = k[..., :32]
    elif change == "k_dtype":
        k = k.float()
    elif change == "q_stride":
        q = torch.randn(q.shape[0], q.shape[1], 128, device=device).half()[..., ::2]
    with pytest.raises(ValueError, match=message):
        apply_rotary_emb(positions, q, k, cos_sin)
