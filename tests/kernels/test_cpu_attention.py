"""genq's compiled CPU attention kernel (kernels.cpu) against the torch backend's path on the
same cache: ragged contexts, block boundaries, GQA ratios, head sizes, dtypes, queries of one
token and of several (guesses, chunks after a prefix, whole prefills), windows, chunked spans,
soft-capping, sinks and both-ways spans, on each instruction set this CPU runs."""

import pytest
import torch

from kernels import cpu as cpu_kernels
from worker.core.scheduler import ScheduledRequest
from worker.model_executor.attention import TorchAttention, write_kv
from worker.model_executor.attention_cpu import CpuAttention, CpuMetadata
from worker.model_executor.models.config import Chunked

BS = 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="genq's CPU kernels could not be built here")


def isas() -> list[str]:
    """The instruction sets this CPU runs (the kernel refuses the others)."""
    flags = open("/proc/cpuinfo").read()
    found = [name for name, flag in (("avx2", " avx2 "), ("avx512", " avx512bw "), ("avx512bf16", " avx512_bf16 "))
             if flag in flags]
    return ["scalar", *found]


def make_batch(shapes: list[tuple[int, int]], both_ways: dict[int, tuple[int, int]] | None = None, bs: int = BS):
    """(start_pos, new tokens) per sequence, each with its own shuffled blocks."""
    num_blocks = sum(-(-(start + n) // bs) for start, n in shapes) + 1
    order = torch.randperm(num_blocks - 1).tolist()
    batch = []
    for i, (start, n) in enumerate(shapes):
        need = -(-(start + n) // bs)
        table = [b + 1 for b in order[:need]]
        order = order[need:]
        spans = ((both_ways[i]),) if both_ways and i in both_ways else ()
        batch.append(ScheduledRequest(str(i), [1] * n, start, table, True, both_ways=spans))
    return batch, num_blocks


def run_both(shapes, num_heads, num_kv_heads, head_dim, dtype, span=None, softcap=None, sinks=False, isa="auto",
             both_ways=None, bs=BS):
    batch, num_blocks = make_batch(shapes, both_ways, bs)
    args = (bs, num_heads, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    reference, compiled = TorchAttention(*args), CpuAttention(*args)
    width = max(len(s.block_table) for s in batch)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in batch])
    positions = torch.cat([torch.arange(s.start_pos, s.start_pos + len(s.token_ids)) for s in batch])
    seq = torch.cat([torch.full((len(s.token_ids),), i) for i, s in enumerate(batch)])
    slots = tables[seq, positions // bs] * bs + positions % bs
    num_tokens = len(positions)
    k_cache = torch.randn(num_blocks, num_kv_heads, bs, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, num_kv_heads, bs, head_dim).to(dtype)
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    sink = torch.randn(num_heads) if sinks else None
    spans = frozenset({span})
    ref_meta = reference.build(batch, tables, slots, spans)
    meta = compiled.build(batch, tables, slots, spans)
    assert isinstance(meta, CpuMetadata)
    scale = head_dim**-0.5
    cache = (k_cache, v_cache)
    expected = ref_meta.forward(q, k, v, cache, scale, span, softcap, sink)
    window = None if isinstance(span, Chunked) else span
    got = cpu_kernels.paged_attention(
        torch.empty_like(q), q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.seq_lens, scale,
        window=window, chunk=span.size if isinstance(span, Chunked) else None, softcap=softcap,
        sinks=sink, attend_until=meta.attend_until, isa=isa)
    return got, expected


def check(got, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


# contexts at block boundaries (k * BS, +-1), ragged, one token and a long one
DECODES = [(0, 1), (BS - 1, 1), (BS, 1), (BS + 1, 1), (3 * BS - 2, 1), (5 * BS, 1), (37, 1), (200, 1)]


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(4, 4, 64), (9, 3, 64), (8, 2, 128), (16, 2, 128), (4, 1, 256), (4, 2, 16), (6, 2, 32),
                          (8, 8, 96)])
def test_decodes_match_the_torch_path(isa, dtype, num_heads, num_kv_heads, head_dim):
    check(*run_both(DECODES, num_heads, num_kv_heads, head_dim, dtype, isa=isa), dtype)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guesses_chunks_and_prefills_match_the_torch_path(isa, dtype):
    # decodes with guesses (q_len 4), short chunks after a prefix, whole prefills (one longer
    # than a work item's tile of queries), a chunk after a long prefix
    shapes = [(20, 4), (BS - 2, 4), (47, 3), (0, 1), (0, 37), (BS, 30), (100, 70), (5, 3)]
    check(*run_both(shapes, 9, 3, 64, dtype, isa=isa), dtype)
    check(*run_both(shapes, 8, 1, 128, dtype, isa=isa), dtype)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("bs", [8, 24, 32, 128])
def test_other_block_sizes_match_the_torch_path(isa, bs):
    # a softmax tile of 64 keys takes several blocks (8, 24, 32) or one (128): contexts ending
    # inside a tile's first, middle and last block, prefills, a window
    shapes = [(0, 1), (bs - 1, 1), (3 * bs + 5, 1), (200, 1), (0, 37), (50, 20)]
    check(*run_both(shapes, 9, 3, 64, torch.bfloat16, isa=isa, bs=bs), torch.bfloat16)
    check(*run_both(shapes, 9, 3, 64, torch.float32, span=40, isa=isa, bs=bs), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("span", [5, BS, 40, Chunked(BS * 2)])
def test_windows_and_chunked_spans_match_the_torch_path(dtype, span):
    shapes = DECODES + [(20, 4), (0, 50), (70, 20)]
    check(*run_both(shapes, 9, 3, 64, dtype, span=span), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_sinks_and_both_ways_spans_match_the_torch_path(dtype):
    shapes = DECODES + [(0, 40), (30, 25)]
    check(*run_both(shapes, 8, 2, 64, dtype, softcap=3.0), dtype)
    check(*run_both(shapes, 8, 2, 64, dtype, sinks=True), dtype)
    check(*run_both(shapes, 8, 2, 64, dtype, span=24, sinks=True, softcap=5.0), dtype)
    both_ways = {len(DECODES): (5, 20), len(DECODES) + 1: (34, 50)}  # an image's span in each prefill
    check(*run_both(shapes, 8, 2, 64, dtype, both_ways=both_ways), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_write_matches_the_torch_path(dtype):
    # k and v as the model hands them: views into one qkv projection's output
    batch, num_blocks = make_batch([(20, 1), (BS - 1, 2), (0, 40), (100, 1)])
    width = max(len(s.block_table) for s in batch)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in batch])
    positions = torch.cat([torch.arange(s.start_pos, s.start_pos + len(s.token_ids)) for s in batch])
    seq = torch.cat([torch.full((len(s.token_ids),), i) for i, s in enumerate(batch)])
    slots = tables[seq, positions // BS] * BS + positions % BS
    qkv = torch.randn(len(positions), (4 + 2 + 2) * 64).to(dtype).view(-1, 8, 64)
    k, v = qkv[:, 4:6], qkv[:, 6:]
    reference = TorchAttention(BS, 4, 2, 64, dtype, torch.device("cpu")).build(batch, tables, slots)
    caches = [torch.randn(num_blocks, 2, BS, 64).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv(k, v, *expected, reference)
    cpu_kernels.write_kv_(*caches, k, v, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    with pytest.raises(RuntimeError, match=f"token 1 names slot {num_blocks * BS} of {num_blocks * BS}"):
        cpu_kernels.write_kv_(*caches, k, v, torch.cat([slots[:1], torch.tensor([num_blocks * BS]), slots[2:]]))
    with pytest.raises(RuntimeError, match="must share one dtype"):
        cpu_kernels.write_kv_(*caches, k.double(), v.double(), slots)


def test_an_fp8_cache_and_unbuilt_head_sizes_take_the_torch_path():
    batch, num_blocks = make_batch([(20, 1), (0, 5)])
    tables = torch.tensor([s.block_table + [0] * (2 - len(s.block_table)) for s in batch])
    slots = torch.tensor([tables[0, 1] * BS + 4] + [tables[1, 0] * BS + i for i in range(5)])
    fp8 = CpuAttention(BS, 4, 2, 64, torch.float32, torch.device("cpu"))
    meta = fp8.build(batch, tables, slots)
    cache = tuple(torch.randn(num_blocks, 2, BS, 64).to(torch.float8_e4m3fn) for _ in range(2))
    q, k, v = torch.randn(6, 4, 64), torch.randn(6, 2, 64), torch.randn(6, 2, 64)
    reference = TorchAttention(BS, 4, 2, 64, torch.float32, torch.device("cpu")).build(batch, tables, slots)
    expected = reference.forward(q, k, v, tuple(c.clone() for c in cache), 0.125)
    torch.testing.assert_close(meta.forward(q, k, v, cache, 0.125), expected)
    assert not CpuAttention(BS, 4, 2, 80, torch.float32, torch.device("cpu")).kernel_serves


def test_bad_arguments_are_refused_with_their_names():
    q = torch.randn(2, 4, 64)
    cache = torch.randn(3, 2, BS, 64)
    tables, starts, lens = torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32), \
        torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head_dim must be 16, 32, 64, 96, 128 or 256"):
        cpu_kernels.paged_attention(torch.empty(2, 4, 80), torch.randn(2, 4, 80), torch.randn(3, 2, BS, 80),
                                    torch.randn(3, 2, BS, 80), tables, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="contiguous int32"):
        cpu_kernels.paged_attention(torch.empty_like(q), q, cache, cache, tables.long(), starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="must have q's dtype"):
        cpu_kernels.paged_attention(torch.empty_like(q), q, cache.bfloat16(), cache.bfloat16(), tables, starts, lens, 1.0)
    # metadata that would read outside q or the caches
    with pytest.raises(RuntimeError, match="names block 3 of 3"):
        cpu_kernels.paged_attention(torch.empty_like(q), q, cache, cache, tables + 3, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="its table holds 1 blocks"):
        cpu_kernels.paged_attention(torch.empty_like(q), q, cache, cache, tables, starts, lens + BS, 1.0)
    with pytest.raises(RuntimeError, match="query_start must run from 0 to q's 2 rows"):
        cpu_kernels.paged_attention(torch.empty_like(q), q, cache, cache, tables, starts.clamp(max=1), lens, 1.0)
    with pytest.raises(RuntimeError, match="attend_until of row 1 is past its context of 1"):
        cpu_kernels.paged_attention(torch.empty_like(q), q, cache, cache, tables, starts, lens, 1.0,
                                    attend_until=torch.tensor([0, 1], dtype=torch.int32))


def test_auto_picks_the_compiled_backend_on_the_cpu_and_bad_names_are_refused():
    from worker.model_executor.attention_selector import resolve_attention_backend

    assert resolve_attention_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_attention_backend("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="'cpu' runs on the CPU only, not on cuda"):
        resolve_attention_backend("cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="must be auto, cpu, torch or triton, got 'gpu'"):
        resolve_attention_backend("gpu", torch.device("cpu"))
