"""Paged attention over the block-table KV cache, for a flat mixed batch.

One launch serves prefill chunks (which attend to their cached prefix plus their own tokens
causally) and decodes (query_len 1) alike. The batch is described as in the engine:

- `query_start_loc` [B + 1] int32: where each sequence's new tokens start in the flat batch;
  rows from `query_start_loc[B]` on are padding and are never read or written.
- `seq_lens` [B] int32: context length including the new tokens, which are its last
  `query_len` positions.
- `block_tables` [B, max_num_blocks_per_seq] int32: physical block of each logical block.
- `attend_until` [T] int32, optional: the last position each new token sees, where some
  see past themselves (Gemma 3's image tokens see their whole image); a sliding window
  or a chunk still bounds what lies before a query.

Grouped-query attention: one program owns one KV head and all `group` query heads that share
it. Its tile rows are (query token, query head) pairs, so each K/V tile is loaded once for the
whole group and the tile height reaches the 16 rows `tl.dot` needs even for one decode token.
Wide heads (MLA's 576 columns) share a group's query heads out 16 to a program instead, so
that the tile fits in shared memory: each such program loads the K/V tiles again.

Split-KV (flash-decoding): with few sequences and long contexts the (sequence, KV head)
programs cannot fill the GPU, so the context is cut into `num_splits` ranges of KV tiles
handled by separate programs. Each writes a normalised partial output and its log-sum-exp;
a second small kernel merges them. Every program of the split launch writes its rows, with
log-sum-exp -inf when its range holds no key the row may see.
"""

import dataclasses
import functools
from dataclasses import dataclass

import torch

from kernels._common import (
    cdiv,
    check_contiguous,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
    dot_dtype,
    is_interpreted,
    next_power_of_2,
    padded_head_dim,
    tl,
    triton,
)

_LOG2E = 1.4426950408889634
_BLOCK_N = 64  # keys per KV tile
# Past this many bytes a row of K or V (MLA's cache head of 576 columns, padded to 1024 in the
# tile) gets 16-key tiles of 16 rows in one stage, a KV head's query heads shared out 16 to a
# program: at 64 keys, K and V alone overflow an H100's 227 KiB of shared memory (the GPU
# check: 580 KiB asked at float32), and 64 heads' rows overflow it at 16 keys.
_WIDE_ROW_BYTES = 512
_WIDE_ROWS = 16
_MIN_TILES_PER_SPLIT = 4  # a split shorter than this costs more in merging than it gains
_MAX_SPLITS = 32
_MERGE_TILE = 4096  # elements of one merge program's [heads, head_dim] accumulator
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,
    out_ptr,  # [T, num_heads, HEAD_DIM], or [num_splits, T, num_heads, HEAD_DIM] fp32 partials
    lse_ptr,  # [num_splits, T, num_heads] fp32, log2 units; only read when SPLIT
    sinks_ptr,  # [num_heads] fp32: each head's sink logit; only read when SINKS
    until_ptr,  # [T] int32: the last position each row's query sees; only read when UNTIL
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_num_blocks_per_seq] int32
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    stride_q_tok,
    stride_q_head,
    stride_o_split,
    stride_o_tok,
    stride_o_head,
    stride_lse_split,
    stride_lse_tok,
    stride_bt_seq,
    stride_cache_slot,  # num_kv_heads * HEAD_DIM
    num_splits,
    tiles_per_split,
    GROUP: tl.constexpr,  # query heads per KV head
    HEADS_P: tl.constexpr,  # the query heads of one program, a power of two: GROUP rounded up, or a share
    HEAD_TILES: tl.constexpr,  # programs sharing a KV head's query heads: GROUP / HEADS_P, rounded up
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * HEADS_P tile rows
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two (at least 16): the tile width
    DOT_DTYPE: tl.constexpr,  # operand dtype of tl.dot
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (tests), else the default "tf32"
    SPLIT: tl.constexpr,  # write fp32 partials and their log-sum-exp
    WINDOW: tl.constexpr,  # a query sees only the last WINDOW positions (itself included); 0: all
    CHUNK: tl.constexpr,  # a query sees only the positions of its own chunk of CHUNK (Llama 4); 0: all
    SOFTCAP: tl.constexpr,  # scores become SOFTCAP * tanh(score / SOFTCAP); 0: uncapped
    SINKS: tl.constexpr,  # a learned logit per head joins each row's softmax, with a zero value
    UNTIL: tl.constexpr,  # queries see up to their until_ptr position, not their own
):
    q_tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    kv_head = tl.program_id(1) // HEAD_TILES
    first_head = tl.program_id(1) % HEAD_TILES * HEADS_P  # of this program, within the KV head's
    seq = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # cached prefix before the new tokens

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // HEADS_P  # [BLOCK_M] new-token index in the sequence
    in_group = first_head + rows % HEADS_P  # [BLOCK_M] query head among the KV head's
    head = kv_head * GROUP + in_group  # [BLOCK_M] query head
    row_valid = (tok < query_len) & (in_group < GROUP)  # [BLOCK_M]
    pos = context_len + tok  # [BLOCK_M] absolute position: keys at <= pos are visible
    last = pos  # [BLOCK_M] the last position a row sees
    if UNTIL:
        last = tl.load(until_ptr + q_start + tok, mask=row_valid, other=0)
    dims = tl.arange(0, HEAD_P)
    dim_ok = dims < HEAD_DIM  # padded columns load as zeros and add nothing to the dots

    q_off = (q_start + tok).to(tl.int64) * stride_q_tok + head * stride_q_head  # [BLOCK_M]
    q_mask = row_valid[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_off[:, None] + dims[None, :], mask=q_mask, other=0.0)
    q = q.to(DOT_DTYPE)  # [BLOCK_M, HEAD_P]

    # Keys this tile of queries can see end at its last token (at the chunk's end, where queries
    # see past themselves); this split owns a range of tiles.
    visible_end = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, query_len)
    if UNTIL:
        visible_end = seq_len
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(visible_end, BLOCK_N))
    if WINDOW > 0:  # tiles wholly before the window of this tile's first query are skipped
        tile_lo = tl.maximum(tile_lo, tl.maximum(context_len + q_tile * BLOCK_Q - WINDOW + 1, 0) // BLOCK_N)
    if CHUNK > 0:  # and those wholly before its chunk
        tile_lo = tl.maximum(tile_lo, (context_len + q_tile * BLOCK_Q) // CHUNK * CHUNK // BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    if SINKS:  # the sink starts the softmax as one more score (in the first split only)
        log2e_ = 1.4426950408889634
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf")) * log2e_
        sink = tl.where(split == 0, sink, float("-inf"))
        m_i = sink
        l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt_seq
    kv_head_off = kv_head * HEAD_DIM
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        kv_valid = kv_pos < seq_len
        block = tl.load(bt_row + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0)  # [BLOCK_N]
        slot = block.to(tl.int64) * BLOCK_SIZE + kv_pos % BLOCK_SIZE
        kv_off = slot * stride_cache_slot + kv_head_off  # [BLOCK_N]
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + dims[:, None],
            mask=kv_valid[None, :] & dim_ok[:, None],
            other=0.0,
        )  # [HEAD_P, BLOCK_N]
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + dims[None, :],
            mask=kv_valid[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, HEAD_P]

        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        visible = (kv_pos[None, :] <= last[:, None]) & kv_valid[None, :]
        if WINDOW > 0:
            visible = visible & (kv_pos[None, :] > pos[:, None] - WINDOW)
        if CHUNK > 0:
            visible = visible & (kv_pos[None, :] >= pos[:, None] // CHUNK * CHUNK)
        if SOFTCAP > 0:  # tanh(x) = 1 - 2 / (exp(2x) + 1), in natural units, then back to log2
            log2e = 1.4426950408889634  # _LOG2E: a kernel reads no module globals
            x = s * (scale_log2 / (log2e * SOFTCAP))
            s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (SOFTCAP * log2e)
        else:
            s = s * scale_log2
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead of -inf.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_sub[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_sub)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # [BLOCK_M, HEAD_P]
    tok_global = (q_start + tok).to(tl.int64)
    split64 = split.to(tl.int64)
    o_off = split64 * stride_o_split + tok_global * stride_o_tok + head * stride_o_head
    o_ptrs = out_ptr + o_off[:, None] + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    if SPLIT:
        empty = l_i == 0.0  # no visible key in this split's range
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        lse_off = split64 * stride_lse_split + tok_global * stride_lse_tok + head
        tl.store(lse_ptr + lse_off, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    part_ptr,  # [num_splits, T, num_heads, HEAD_DIM] fp32, each split normalised
    lse_ptr,  # [num_splits, T, num_heads] fp32, log2 units
    out_ptr,  # [T, num_heads, HEAD_DIM]
    query_start_loc_ptr,  # [B + 1] int32
    num_seqs,
    num_heads,
    num_splits,
    stride_p_split,
    stride_p_tok,
    stride_p_head,
    stride_lse_split,
    stride_lse_tok,
    stride_o_tok,
    stride_o_head,
    SPLITS_P: tl.constexpr,  # num_splits rounded up to a power of two
    BLOCK_H: tl.constexpr,  # query heads per program
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
):
    tok = tl.program_id(0).to(tl.int64)
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return  # a padding row: leave it untouched
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_valid = heads < num_heads
    splits = tl.arange(0, SPLITS_P)
    dims = tl.arange(0, HEAD_P)
    mask = head_valid[:, None] & (dims < HEAD_DIM)[None, :]  # [BLOCK_H, HEAD_P]
    lse_off = splits[:, None] * stride_lse_split + tok * stride_lse_tok + heads[None, :]
    lse_mask = (splits[:, None] < num_splits) & head_valid[None, :]
    lse = tl.load(lse_ptr + lse_off, mask=lse_mask, other=float("-inf"))  # [SPLITS_P, BLOCK_H]
    m = tl.max(lse, 0)  # [BLOCK_H]; finite for real rows: split 0 always sees position 0
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m[None, :]), 0)  # [BLOCK_H]
    total = tl.where(total == 0.0, 1.0, total)

    acc = tl.zeros([BLOCK_H, HEAD_P], tl.float32)
    p_off = tok * stride_p_tok + heads[:, None] * stride_p_head + dims[None, :]  # [BLOCK_H, HEAD_P]
    for split in range(num_splits):
        split64 = tl.cast(split, tl.int64)
        split_lse = tl.load(
            lse_ptr + split64 * stride_lse_split + tok * stride_lse_tok + heads,
            mask=head_valid,
            other=float("-inf"),
        )  # [BLOCK_H]
        weight = tl.exp2(split_lse - m) / total  # [BLOCK_H]
        part = tl.load(part_ptr + split64 * stride_p_split + p_off, mask=mask, other=0.0)
        acc += part * weight[:, None]
    o_ptrs = out_ptr + tok * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class _Tiling:
    group: int  # query heads per KV head
    heads_p: int  # query heads per program, a power of two
    head_tiles: int  # programs per KV head along its query heads
    block_q: int  # query tokens per program
    block_m: int  # tile rows: block_q * heads_p
    num_q_tiles: int  # programs along the query axis, per sequence
    num_warps: int
    block_n: int = _BLOCK_N  # keys per KV tile
    num_stages: int = 3  # Triton's software pipelining of the KV loads (its default on CUDA)


def _choose_tiling(group: int, max_query_len: int, head_p: int, element_size: int = 2) -> _Tiling:
    group_p = next_power_of_2(group)
    wide = head_p * element_size > _WIDE_ROW_BYTES
    heads_p = min(group_p, _WIDE_ROWS) if wide else group_p
    # Decode-heavy batches need only 16 rows (the tl.dot minimum); prefills get taller tiles.
    block_m = 16 if wide or max_query_len * heads_p <= 16 else 64
    block_m = max(block_m, heads_p)
    block_q = block_m // heads_p
    num_q_tiles = cdiv(max(max_query_len, 1), block_q)
    # Past 64 x 128 accumulator rows x dims, 4 warps run short of registers (ptxas: ~200/thread).
    num_warps = 8 if block_m * head_p >= 64 * 128 else 4
    tiling = _Tiling(group, heads_p, cdiv(group, heads_p), block_q, block_m, num_q_tiles, num_warps)
    return dataclasses.replace(tiling, block_n=16, num_stages=1) if wide else tiling


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """How many KV ranges to split each context into so the launch fills `num_sms` SMs.

    `num_programs` counts the unsplit programs (sequences x KV heads x query tiles). A split
    is only worth it when the programs are too few for the GPU and the contexts long enough
    that every split still owns a few KV tiles.
    """
    target = 2 * num_sms
    if num_programs >= target:
        return 1
    longest = max(1, cdiv(max_seq_len, _BLOCK_N) // _MIN_TILES_PER_SPLIT)
    return max(1, min(cdiv(target, num_programs), longest, _MAX_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: splitting only slows it down
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    check_dtype("q", q, _DTYPES)
    check_shape("q", q, (None, None, None))
    num_tokens, num_heads, head_dim = q.shape
    check_shape("k_cache", k_cache, (None, None, None, head_dim))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, cache, (q.dtype, torch.float8_e4m3fn))  # fp8: widened as it is read
        check_contiguous(name, cache)
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_last_dim_contiguous("q", q)
    num_seqs = seq_lens.shape[0]
    for name, t, shape in (
        ("query_start_loc", query_start_loc, (num_seqs + 1,)),
        ("seq_lens", seq_lens, (num_seqs,)),
        ("block_tables", block_tables, (num_seqs, None)),
    ):
        check_dtype(name, t, (torch.int32,))
        check_shape(name, t, shape)
        check_last_dim_contiguous(name, t)
    if out is not None:
        check_dtype("out", out, (q.dtype,))
        check_shape("out", out, (num_tokens, num_heads, head_dim))
        check_last_dim_contiguous("out", out)


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_num_blocks_per_seq] int32
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
    attend_until: torch.Tensor | None = None,  # [T] int32
    chunk_size: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention of the batch's new tokens over their paged contexts.

    The new tokens' K/V must already be in the cache (see `reshape_and_cache`). `scale`
    defaults to head_dim ** -0.5. `max_query_len` and `max_seq_len` must be upper bounds of
    the batch's; when None they are read from the tensors, which synchronises with the GPU
    (pass them, e.g. max_model_len, under CUDA graphs). `num_splits` None chooses a KV split
    count from the batch shape and the GPU; 1 disables splitting. Rows of `out` from
    `query_start_loc[B]` on (padding) are left untouched. `sinks` (GPT-OSS): a logit per
    query head that takes its share of every row's softmax and contributes no value.
    `attend_until`: the last position each row sees (at least its own, within its
    sequence's context), where some rows see keys after their own. `chunk_size` (Llama 4's
    chunked attention): a row sees only the positions of its own chunk of that many.
    """
    _check_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out)
    if attend_until is not None:
        check_dtype("attend_until", attend_until, (torch.int32,))
        check_shape("attend_until", attend_until, (q.shape[0],))
        check_contiguous("attend_until", attend_until)
    if sinks is not None:
        check_dtype("sinks", sinks, (torch.float32,))
        check_shape("sinks", sinks, (q.shape[1],))
        check_contiguous("sinks", sinks)
    device = check_device(
        _paged_attention_kernel,
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        **({} if out is None else {"out": out}),
    )
    if out is None:
        out = torch.empty_like(q)
    num_seqs, num_tokens = seq_lens.shape[0], q.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    tiling = _choose_tiling(q.shape[1] // k_cache.shape[2], max_query_len, padded_head_dim(q.shape[2]),
                            q.element_size())
    if num_splits is None:
        programs = num_seqs * k_cache.shape[2] * tiling.head_tiles * tiling.num_q_tiles
        num_splits = choose_num_splits(programs, max_seq_len, _num_sms(device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    scale = q.shape[2] ** -0.5 if scale is None else scale
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    launch = _Launch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, tiling,
                     sliding_window or 0, chunk_size or 0, softcap or 0.0, sinks, attend_until)
    if num_splits == 1:
        launch.run(out, None, 1, max_seq_len)
    else:
        _run_split(launch, out, num_splits, max_seq_len)
    return out


@dataclass
class _Launch:
    """The attention kernel's fixed arguments, launched unsplit or into split partials."""

    q: torch.Tensor  # [T, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_num_blocks_per_seq]
    scale: float
    tiling: _Tiling
    window: int  # 0: none
    chunk: int  # 0: none
    softcap: float  # 0: none
    sinks: torch.Tensor | None  # [num_heads] float32
    attend_until: torch.Tensor | None  # [T] int32

    def run(
        self,
        out: torch.Tensor,  # [T, num_heads, head_dim] or [num_splits, T, num_heads, head_dim]
        lse: torch.Tensor | None,  # [num_splits, T, num_heads] when splitting
        num_splits: int,
        max_seq_len: int,
    ) -> None:
        t = self.tiling
        num_kv_heads, head_dim = self.k_cache.shape[2], self.k_cache.shape[3]
        split = lse is not None
        o_strides = out.stride() if split else (0, *out.stride())
        lse_strides = lse.stride()[:2] if lse is not None else (0, 0)
        grid = (t.num_q_tiles * num_splits, num_kv_heads * t.head_tiles, self.seq_lens.shape[0])
        _paged_attention_kernel[grid](
            self.q, self.k_cache, self.v_cache, out, out if lse is None else lse,
            self.q if self.sinks is None else self.sinks,
            self.q if self.attend_until is None else self.attend_until,
            self.query_start_loc, self.seq_lens, self.block_tables,
            self.scale * _LOG2E,
            self.q.stride(0), self.q.stride(1),
            o_strides[0], o_strides[1], o_strides[2],
            lse_strides[0], lse_strides[1],
            self.block_tables.stride(0),
            num_kv_heads * head_dim,
            num_splits,
            cdiv(cdiv(max_seq_len, t.block_n), num_splits),
            GROUP=t.group, HEADS_P=t.heads_p, HEAD_TILES=t.head_tiles, BLOCK_Q=t.block_q, BLOCK_M=t.block_m,
            BLOCK_N=t.block_n, BLOCK_SIZE=self.k_cache.shape[1], HEAD_DIM=head_dim, HEAD_P=padded_head_dim(head_dim),
            DOT_DTYPE=dot_dtype(self.q.dtype, is_interpreted(_paged_attention_kernel)),
            DOT_PRECISION="ieee" if self.q.dtype == torch.float32 else "tf32",
            SPLIT=split, WINDOW=self.window, CHUNK=self.chunk, SOFTCAP=self.softcap, SINKS=self.sinks is not None,
            UNTIL=self.attend_until is not None,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip


def _run_split(launch: _Launch, out: torch.Tensor, num_splits: int, max_seq_len: int) -> None:
    num_tokens, num_heads, head_dim = launch.q.shape
    device = launch.q.device
    parts = torch.empty(
        (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=device
    )  # [num_splits, T, num_heads, head_dim]
    lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=device)
    launch.run(parts, lse, num_splits, max_seq_len)
    block_h = min(next_power_of_2(num_heads), max(1, _MERGE_TILE // padded_head_dim(head_dim)))
    _merge_splits_kernel[(num_tokens, cdiv(num_heads, block_h))](
        parts, lse, out, launch.query_start_loc,
        launch.seq_lens.shape[0], num_heads, num_splits,
        parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        SPLITS_P=next_power_of_2(num_splits), BLOCK_H=block_h, HEAD_DIM=head_dim, HEAD_P=padded_head_dim(head_dim),
        num_warps=4,
    )  # fmt: skip


def paged_attention_ref(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_num_blocks_per_seq] int32
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    attend_until: torch.Tensor | None = None,  # [T]
    chunk_size: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]; padding rows are zero
    """Plain-torch paged attention, one sequence at a time, computed in float32 (an fp8
    cache's values widened as they are)."""
    if k_cache.dtype == torch.float8_e4m3fn:
        k_cache, v_cache = k_cache.float(), v_cache.float()
    head_dim = q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        blocks = block_tables[b, : cdiv(seq_len, block_size)].long()  # [num_seq_blocks]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, kvh, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        until = None if attend_until is None else attend_until[start:end]
        out[start:end] = _dense_causal_attention(q[start:end], k, v, scale, sliding_window, softcap, sinks,
                                                 until, chunk_size).to(q.dtype)
    return out


def _dense_causal_attention(
    q: torch.Tensor,  # [query_len, num_heads, D]: the last query_len positions of the context
    k: torch.Tensor,  # [seq_len, num_kv_heads, D]
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]: one more logit per row, whose value is zero
    until: torch.Tensor | None = None,  # [query_len]: the last position each query sees (None: its own)
    chunk: int | None = None,  # each query sees only its own chunk of this many positions
) -> torch.Tensor:  # [query_len, num_heads, D] float32
    query_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [num_heads, query_len, seq_len]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(seq_len - query_len, seq_len, device=q.device)  # [query_len]
    kv_pos = torch.arange(seq_len, device=q.device)[None, :]
    visible = kv_pos <= (pos if until is None else until.long())[:, None]
    if window is not None:
        visible &= kv_pos > pos[:, None] - window
    if chunk is not None:
        visible &= kv_pos >= (pos // chunk * chunk)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.float()[:, None, None].expand(-1, query_len, 1)  # [num_heads, query_len, 1]
        probs = torch.cat((scores, sink_column), dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hqk,khd->qhd", probs, v)
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


__all__ = ["choose_num_splits", "paged_attention", "paged_attention_ref"]
