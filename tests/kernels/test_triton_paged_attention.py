"""Paged attention kernel against its torch reference, and the reference against SDPA."""

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import ON_CUDA, PagedBatch, assert_close, make_paged_batch

from kernels import choose_num_splits, paged_attention, paged_attention_ref, reshape_and_cache

# name: (query_lens, seq_lens, block_size)
CASES = {
    # a decode over a long context, a chunk after a cached prefix, a prefill without prefix
    "mixed": ([1, 5, 1, 20], [37, 70, 130, 20], 16),
    # contexts of one token, exactly one block, exactly one KV tile
    "decodes": ([1, 1, 1], [1, 16, 64], 16),
    # a chunk whose prefix and tokens cross several small blocks and two KV tiles
    "chunk_crossing_blocks": ([33], [97], 8),
}
GQA = {"mha": (4, 4), "gqa3": (6, 2), "gqa4": (8, 2)}  # (num_heads, num_kv_heads)


def _run(batch: PagedBatch, **kwargs: object) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))  # [T, num_heads, head_dim]
    result = paged_attention(*batch.attention_args(), out=out, **kwargs)
    assert result is out
    return out


def _check(batch: PagedBatch, out: torch.Tensor, scale: float | None = None) -> None:
    expected = paged_attention_ref(*batch.attention_args(), scale=scale)
    n = batch.num_real_tokens
    assert_close(out[:n], expected[:n])


@pytest.mark.parametrize("gqa", GQA.values(), ids=GQA.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(device: torch.device, case: tuple, gqa: tuple[int, int]) -> None:
    query_lens, seq_lens, block_size = case
    batch = make_paged_batch(query_lens, seq_lens, *gqa, 64, block_size, torch.float16, device)
    _check(batch, _run(batch, num_splits=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dtypes(device: torch.device, dtype: torch.dtype) -> None:
    query_lens, seq_lens, block_size = CASES["mixed"]
    batch = make_paged_batch(query_lens, seq_lens, 6, 2, 64, block_size, dtype, device)
    _check(batch, _run(batch))


def test_head_dim_128_block_size_32(device: torch.device) -> None:
    batch = make_paged_batch([1, 7], [45, 50], 8, 2, 128, 32, torch.bfloat16, device)
    _check(batch, _run(batch))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", [96, 8], ids=["phi3", "under16"])
def test_head_dim_not_a_power_of_two(device: torch.device, head_dim: int, num_splits: int) -> None:
    """Phi-3's 96 runs in 128-wide tiles (and 8 in 16-wide): the padded columns read as zeros
    and are never written, split partials and their merge included."""
    batch = make_paged_batch([1, 6, 1], [40, 70, 3], 6, 2, head_dim, 16, torch.bfloat16, device)
    _check(batch, _run(batch, num_splits=num_splits))


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv(device: torch.device, num_splits: int) -> None:
    # 8 splits of a 3-tile context leave empty splits, whose partials must not count.
    batch = make_paged_batch([1, 4, 1], [150, 90, 3], 8, 2, 64, 16, torch.float16, device)
    _check(batch, _run(batch, num_splits=num_splits))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 16, 50, 200])  # itself only; under a tile; across tiles; past every context
def test_sliding_window(device: torch.device, window: int, num_splits: int) -> None:
    """Queries see only their last `window` positions: tiles wholly before a window are
    skipped, and the splits that then hold nothing must not count."""
    batch = make_paged_batch([1, 5, 1, 33], [150, 90, 3, 97], 8, 2, 64, 16, torch.float32, device)
    out = _run(batch, num_splits=num_splits, sliding_window=window)
    expected = paged_attention_ref(*batch.attention_args(), sliding_window=window)
    assert_close(out[: batch.num_real_tokens], expected[: batch.num_real_tokens])
    if window < 90:  # the window changed something: it is not plain causal attention
        causal = paged_attention_ref(*batch.attention_args())
        assert not torch.allclose(expected, causal)


# itself only; under a tile; a tile; tiles cut mid-way (split, so some splits hold nothing)
@pytest.mark.parametrize("chunk, num_splits", [(1, 1), (16, 3), (64, 1), (100, 3)])
def test_chunked(device: torch.device, chunk: int, num_splits: int) -> None:
    """Llama 4's chunked attention: queries see only their own chunk, from its start to
    themselves. A chunk after a cached prefix (33 tokens at 64..96) crosses a chunk
    boundary; tiles wholly before a chunk are skipped, and the splits that then hold nothing
    must not count."""
    batch = make_paged_batch([1, 5, 1, 33], [150, 90, 3, 97], 8, 2, 64, 16, torch.float32, device)
    out = _run(batch, num_splits=num_splits, chunk_size=chunk)
    expected = paged_attention_ref(*batch.attention_args(), chunk_size=chunk)
    assert_close(out[: batch.num_real_tokens], expected[: batch.num_real_tokens])
    causal = paged_attention_ref(*batch.attention_args())
    assert not torch.allclose(expected, causal)  # the chunks changed something


@pytest.mark.parametrize("window", [None, 40])
def test_softcap(device: torch.device, window: int | None) -> None:
    """Gemma2's capped scores (cap * tanh(score / cap)), with and without a window; the
    scale is large so that the cap bites."""
    batch = make_paged_batch([1, 5, 33], [150, 90, 97], 8, 2, 64, 16, torch.float32, device)
    out = _run(batch, num_splits=2, scale=0.5, sliding_window=window, softcap=5.0)
    expected = paged_attention_ref(*batch.attention_args(), scale=0.5, sliding_window=window, softcap=5.0)
    assert_close(out[: batch.num_real_tokens], expected[: batch.num_real_tokens])
    uncapped = paged_attention_ref(*batch.attention_args(), scale=0.5, sliding_window=window)
    assert not torch.allclose(expected, uncapped)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 16])
def test_sinks(device: torch.device, window: int | None, num_splits: int) -> None:
    """GPT-OSS: a logit per query head joins each row's softmax and adds no value; split
    contexts count it once (in the first split, even where the window leaves that split no key)."""
    batch = make_paged_batch([1, 5, 33], [150, 90, 97], 8, 2, 64, 16, torch.float32, device)
    sinks = torch.linspace(-2.0, 3.0, 8, device=device)
    out = _run(batch, num_splits=num_splits, sliding_window=window, sinks=sinks)
    expected = paged_attention_ref(*batch.attention_args(), sliding_window=window, sinks=sinks)
    n = batch.num_real_tokens
    assert_close(out[:n], expected[:n])
    plain = paged_attention_ref(*batch.attention_args(), sliding_window=window)
    assert not torch.allclose(expected[:n], plain[:n])


def test_sink_reference_on_one_key() -> None:
    """One query, one key: softmax over (score, sink) weighs the value by sigmoid(score - sink)."""
    q, k, v = torch.randn(1, 2, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    sinks = torch.tensor([0.5, -1.0])
    bt, qsl, sl = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    out = paged_attention_ref(q, k[None], v[None], qsl, sl, bt, scale=0.25, sinks=sinks)
    score = (q * k).sum(-1) * 0.25  # [1, 2]
    torch.testing.assert_close(out, v * torch.sigmoid(score - sinks)[..., None])


def test_padding_rows_left_untouched(device: torch.device) -> None:
    batch = make_paged_batch([2, 1], [40, 9], 6, 2, 64, 16, torch.float16, device, 3)
    for num_splits in (1, 2):
        out = _run(batch, num_splits=num_splits)
        _check(batch, out)
        assert out[batch.num_real_tokens :].isnan().all()


def test_strided_q_and_custom_scale(device: torch.device) -> None:
    batch = make_paged_batch([3, 1], [19, 33], 8, 2, 64, 16, torch.float16, device)
    qkv = torch.randn(batch.q.shape[0], 12, 64, device=device).to(torch.float16)
    qkv[:, :8] = batch.q
    batch.q = qkv[:, :8]  # a view of a fused projection: token stride 12 * 64
    out = _run(batch, scale=0.3, max_query_len=3, max_seq_len=33)
    _check(batch, out, scale=0.3)


def test_empty_batch(device: torch.device) -> None:
    batch = make_paged_batch([1], [5], 4, 4, 64, 16, torch.float16, device)
    q = batch.q[:0]
    out = paged_attention(q, *batch.attention_args()[1:3], batch.query_start_loc[:1],
                          batch.seq_lens[:0], batch.block_tables[:0])  # fmt: skip
    assert out.shape == (0, 4, 64)


def test_after_reshape_and_cache(device: torch.device) -> None:
    """The engine's order: write the new tokens' K/V into the cache, then attend."""
    batch = make_paged_batch([1, 6], [24, 6], 6, 2, 64, 8, torch.float16, device, 2)
    new_k = torch.cat([k[-q:] for k, q in zip(batch.dense_k, [1, 6], strict=True)])  # [7, kvh, D]
    new_v = torch.cat([v[-q:] for v, q in zip(batch.dense_v, [1, 6], strict=True)])
    real_slots = batch.slot_mapping[: batch.num_real_tokens]
    batch.k_cache.view(-1, 2, 64)[real_slots] = float("nan")
    batch.v_cache.view(-1, 2, 64)[real_slots] = float("nan")
    pad = torch.randn(2, 2, 64, device=device).to(torch.float16)
    reshape_and_cache(torch.cat([new_k, pad]), torch.cat([new_v, pad]),
                      batch.k_cache, batch.v_cache, batch.slot_mapping)  # fmt: skip
    _check(batch, _run(batch))


@pytest.mark.skipif(not ON_CUDA, reason="full sizes only on CUDA")
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)], ids=["smollm2", "llama8b"])
def test_full_size_on_cuda(device: torch.device, heads: tuple[int, int, int]) -> None:
    num_seqs = 64
    query_lens = [1] * 56 + [64] * 4 + [512] * 4
    seq_lens = [2048 - 7 * i for i in range(num_seqs)]
    batch = make_paged_batch(query_lens, seq_lens, *heads, 16, torch.bfloat16, device)
    _check(batch, _run(batch))
    decode = make_paged_batch([1] * 4, [2048, 1500, 999, 17], *heads, 16, torch.float16, device)
    _check(decode, _run(decode))  # few sequences: the automatic split kicks in


# --- the oracle itself ---------------------------------------------------------------------


@pytest.mark.parametrize("gqa", GQA.values(), ids=GQA.keys())
def test_reference_matches_sdpa(gqa: tuple[int, int]) -> None:
    """paged_attention_ref against SDPA on the dense, unpaged K/V of each sequence."""
    query_lens, seq_lens, block_size = CASES["mixed"]
    cpu = torch.device("cpu")
    batch = make_paged_batch(query_lens, seq_lens, *gqa, 64, block_size, torch.float32, cpu)
    actual = paged_attention_ref(*batch.attention_args())
    windowed = paged_attention_ref(*batch.attention_args(), sliding_window=24)
    chunked = paged_attention_ref(*batch.attention_args(), chunk_size=24)
    starts = batch.query_start_loc.tolist()
    for b, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        q = batch.q[starts[b] : starts[b + 1]].transpose(0, 1)  # [num_heads, query_len, D]
        k = batch.dense_k[b].transpose(0, 1)  # [num_kv_heads, seq_len, D]
        v = batch.dense_v[b].transpose(0, 1)
        # bottom-right aligned causal mask: query i sits at position seq_len - query_len + i
        mask = torch.ones(query_len, seq_len, dtype=torch.bool).tril(seq_len - query_len)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(actual[starts[b] : starts[b + 1]], expected.transpose(0, 1))
        # and a 24-position window: the band of the mask's last 24 diagonals
        band = mask & ~torch.ones(query_len, seq_len, dtype=torch.bool).tril(seq_len - query_len - 24)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True)
        torch.testing.assert_close(windowed[starts[b] : starts[b + 1]], expected.transpose(0, 1))
        # and chunks of 24: a query sees from its chunk's start, a multiple of 24, to itself
        pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        own = mask & (torch.arange(seq_len)[None, :] >= pos - pos % 24)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=own, enable_gqa=True)
        torch.testing.assert_close(chunked[starts[b] : starts[b + 1]], expected.transpose(0, 1))


# --- launcher checks -------------------------------------------------------------------------


def _bad_inputs(batch: PagedBatch) -> dict[str, tuple[tuple, dict, str]]:
    q, kc, vc, qsl, sl, bt = batch.attention_args()
    strided_kc = kc.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, not contiguous
    half = (kc[..., ::2].contiguous(), vc[..., ::2].contiguous())
    return {
        "int q": ((q.to(torch.int32), kc, vc, qsl, sl, bt), {}, "q must have dtype"),
        "cache dtype": ((q, kc.float(), vc, qsl, sl, bt), {}, "k_cache must have dtype"),
        "cache strides": ((q, strided_kc, vc, qsl, sl, bt), {}, "k_cache must be contiguous"),
        "v shape": ((q, kc, vc[:-1], qsl, sl, bt), {}, "v_cache must have shape"),
        "heads": ((q[:, :3], kc, vc, qsl, sl, bt), {}, "not a multiple of num_kv_heads"),
        "head_dim": ((q[..., :48], kc, vc, qsl, sl, bt), {}, "k_cache must have shape"),
        "q stride": ((q[..., ::2], *half, qsl, sl, bt), {}, "contiguous last dimension"),
        "seq_lens int64": ((q, kc, vc, qsl, sl.long(), bt), {}, "seq_lens must have dtype"),
        "query_start_loc": ((q, kc, vc, qsl[:-1], sl, bt), {}, "query_start_loc must have shape"),
        "block_tables": ((q, kc, vc, qsl, sl, bt[:1]), {}, "block_tables must have shape"),
        "out shape": ((q, kc, vc, qsl, sl, bt), {"out": q[:1]}, "out must have shape"),
        "out dtype": ((q, kc, vc, qsl, sl, bt), {"out": q.float()}, "out must have dtype"),
        "num_splits": ((q, kc, vc, qsl, sl, bt), {"num_splits": 0}, "num_splits"),
        "chunk_size": ((q, kc, vc, qsl, sl, bt), {"chunk_size": 0}, "chunk_size must be >= 1"),
    }


BAD_INPUTS = [
    "int q", "cache dtype", "cache strides", "v shape", "heads", "head_dim", "q stride",
    "seq_lens int64", "query_start_loc", "block_tables", "out shape", "out dtype", "num_splits", "chunk_size",
]  # fmt: skip


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_launcher_rejects_bad_inputs(device: torch.device, name: str) -> None:
    batch = make_paged_batch([2, 1], [20, 9], 4, 2, 64, 16, torch.float16, device)
    args, kwargs, message = _bad_inputs(batch)[name]
    with pytest.raises(ValueError, match=message):
        paged_attention(*args, **kwargs)


@pytest.mark.skipif(not ON_CUDA, reason="needs a second device")
def test_launcher_rejects_mixed_devices(device: torch.device) -> None:
    batch = make_paged_batch([2, 1], [20, 9], 4, 2, 64, 16, torch.float16, device)
    q, *rest = batch.attention_args()
    with pytest.raises(ValueError, match="one device"):
        paged_attention(q.cpu(), *rest)


def test_choose_num_splits() -> None:
    assert choose_num_splits(num_programs=64 * 8, max_seq_len=4096, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_seq_len=64, num_sms=132) == 1  # short context
    splits = choose_num_splits(num_programs=8, max_seq_len=4096, num_sms=132)
    assert 1 < splits <= 4096 // 64 // 4  # each split keeps at least four 64-key tiles
    assert choose_num_splits(num_programs=1, max_seq_len=10**6, num_sms=132) <= 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_cache(device: torch.device, dtype: torch.dtype, num_splits: int) -> None:
    """kv_cache_dtype="fp8": K and V read from an e4m3 cache, widened to the query's dtype."""
    query_lens, seq_lens, block_size = CASES["mixed"]
    batch = make_paged_batch(query_lens, seq_lens, 6, 2, 64, block_size, dtype, device)
    batch.k_cache = batch.k_cache.nan_to_num(0.0).to(torch.float8_e4m3fn)  # poison is for the wide caches
    batch.v_cache = batch.v_cache.nan_to_num(0.0).to(torch.float8_e4m3fn)
    out = _run(batch, num_splits=num_splits)
    _check(batch, out)
    wide = paged_attention_ref(batch.q, batch.k_cache.to(dtype), batch.v_cache.to(dtype), *batch.attention_args()[3:])
    assert_close(out[: batch.num_real_tokens], wide[: batch.num_real_tokens])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 16])
def test_rows_that_see_past_themselves(device: torch.device, window: int | None, num_splits: int) -> None:
    """Gemma 3's image tokens: each sees up to its image's last position (`attend_until`),
    the rest causally; a window still bounds what lies before a query. Against the
    reference, and the reference against SDPA given the mask written out."""
    query_lens, seq_lens = [1, 5, 33], [150, 90, 97]
    batch = make_paged_batch(query_lens, seq_lens, 8, 2, 64, 16, torch.float32, device)
    positions = [p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)]
    image = range(70, 80)  # in the 33-token chunk, whose context starts at 64
    until = torch.tensor([79 if i >= 6 and p in image else p for i, p in enumerate(positions)], dtype=torch.int32)
    until = until.to(device)
    out = _run(batch, num_splits=num_splits, sliding_window=window, attend_until=until)
    expected = paged_attention_ref(*batch.attention_args(), sliding_window=window, attend_until=until)
    assert_close(out[: batch.num_real_tokens], expected[: batch.num_real_tokens])
    causal = paged_attention_ref(*batch.attention_args(), sliding_window=window)
    changed = (expected - causal).abs().amax(dim=(1, 2)) > 1e-6
    assert changed.nonzero().flatten().tolist() == [6 + p - 64 for p in image[:-1]]  # all but the image's last
    # the chunk's rows through SDPA, each query's keys written out
    k, v = batch.dense_k[2].float(), batch.dense_v[2].float()  # [97, kv heads, D]
    q = batch.q[6:39].float()
    pos, kv = torch.arange(64, 97, device=device)[:, None], torch.arange(97, device=device)[None, :]
    allowed = kv <= until[6:39].long()[:, None]
    if window is not None:
        allowed &= kv > pos - window
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(4, 1).transpose(0, 1),
                                          v.repeat_interleave(4, 1).transpose(0, 1), attn_mask=allowed)
    assert_close(expected[6:39].float(), sdpa.transpose(0, 1))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_heads", [16, 40], ids=["one_program", "heads_shared_out"])
def test_wide_latent_heads(device: torch.device, num_heads: int, num_splits: int) -> None:
    """MLA's one cache head of 512 + 64 columns (1024-wide tiles, 16 keys each): 16 query heads
    in one program, or 40 shared out 16 to a program (the last with 8 of its 16 rows padding),
    as a tile of all 40 would overflow a GPU's shared memory."""
    batch = make_paged_batch([1, 5, 1], [40, 37, 3], num_heads, 1, 576, 16, torch.bfloat16, device)
    _check(batch, _run(batch, num_splits=num_splits))
