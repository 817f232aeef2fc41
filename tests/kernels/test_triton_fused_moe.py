"""The fused mixture-of-experts kernel against its dense torch reference, and the alignment
that groups rows by expert against a plain Python grouping."""

import pytest
import torch
from kernel_cases import ON_CUDA, assert_close
from test_triton_quant_linear import asymmetric_int, quantize, quantize_int

from kernels import fused_moe, fused_moe_ref, moe_align

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# (tokens, experts, top_k, hidden, intermediate): a decode token, sizes off the tile grid,
# more experts than tokens use (empty runs)
CASES = [(1, 4, 2, 64, 96), (37, 8, 3, 96, 48), (5, 16, 2, 64, 64)]
if ON_CUDA:
    CASES += [(512, 8, 2, 1024, 1408), (2048, 64, 8, 512, 256)]


def _routing(num_tokens: int, num_experts: int, top_k: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(torch.randn(num_tokens, num_experts, device=device), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights.to(dtype), ids


def _inputs(case, dtype, device):
    num_tokens, num_experts, top_k, hidden, inter = case
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) * inter**-0.5).to(dtype)
    return x, w13, w2


@pytest.mark.parametrize("block_m", [16, 64])
def test_moe_align_groups_every_pair_under_its_expert(device: torch.device, block_m: int) -> None:
    num_experts, top_k = 8, 3
    _, ids = _routing(29, num_experts, top_k, device, torch.float32)
    ids[:, 0] = 5  # one expert with a run longer than a tile
    sorted_ids, block_experts = moe_align(ids, num_experts, block_m)
    flat = ids.flatten().tolist()
    num_pairs = len(flat)
    assert sorted_ids.shape[0] % block_m == 0 and sorted_ids.shape[0] == block_m * block_experts.shape[0]
    rows = sorted_ids.tolist()
    assert sorted(r for r in rows if r != num_pairs) == list(range(num_pairs))  # each pair once
    expected_tiles = []
    for expert in range(num_experts):  # runs in expert order, pairs in order within a run
        run = [p for p, e in enumerate(flat) if e == expert]
        for start in range(0, len(run), block_m):
            tile = run[start : start + block_m]
            expected_tiles.append((expert, tile + [num_pairs] * (block_m - len(tile))))
    tiles = [(block_experts[t].item(), rows[t * block_m : (t + 1) * block_m])
             for t in range(block_experts.shape[0])]
    assert tiles[: len(expected_tiles)] == expected_tiles
    assert all(e == num_experts and r == [num_pairs] * block_m for e, r in tiles[len(expected_tiles) :])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("weights_dtype", ["fp32", "act"])  # Mixtral's float32 weights, Qwen's rounded ones
def test_fused_moe_matches_reference(device: torch.device, case, dtype: torch.dtype, weights_dtype: str) -> None:
    x, w13, w2 = _inputs(case, dtype, device)
    weights, ids = _routing(case[0], case[1], case[2], device, torch.float32 if weights_dtype == "fp32" else dtype)
    assert_close(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_with_biases_and_another_activation(device: torch.device, dtype: torch.dtype) -> None:
    """gpt-oss's experts: a bias on each projection (the down one before the routing weight)
    and a gated unit of its own, run in torch between the launches."""
    case = (37, 8, 3, 96, 48)
    x, w13, w2 = _inputs(case, dtype, device)
    weights, ids = _routing(*case[:3], device, dtype)
    b13 = torch.randn(8, 96, device=device).to(dtype)
    b2 = torch.randn(8, 96, device=device).to(dtype)

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return (up.clamp(-1.0, 1.0) + 1) * gate.clamp(max=1.0)

    kwargs = dict(activation=act, w13_bias=b13, w2_bias=b2)
    expected = fused_moe_ref(x, w13, w2, weights, ids, **kwargs)
    assert_close(fused_moe(x, w13, w2, weights, ids, **kwargs), expected)
    assert not torch.allclose(expected, fused_moe_ref(x, w13, w2, weights, ids), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_experts_without_a_gate(device: torch.device, dtype: torch.dtype) -> None:
    """Nemotron 3's experts: w13 holds up rows alone (as many as w2 has columns), ReLU^2
    between the launches."""
    num_tokens, num_experts, top_k, hidden, inter = 37, 8, 3, 96, 48
    x, _, w2 = _inputs((num_tokens, num_experts, top_k, hidden, inter), dtype, device)
    up = (torch.randn(num_experts, inter, hidden, device=device) * hidden**-0.5).to(dtype)
    weights, ids = _routing(num_tokens, num_experts, top_k, device, torch.float32)

    def relu2(h: torch.Tensor) -> torch.Tensor:
        return torch.relu(h).square()

    expected = fused_moe_ref(x, up, w2, weights, ids, activation=relu2, gated=False)
    assert_close(fused_moe(x, up, w2, weights, ids, activation=relu2, gated=False), expected)
    dense = torch.einsum("tki,tkhi->tkh", relu2(torch.einsum("th,tkih->tki", x.float(), up[ids].float())),
                         w2[ids].float())  # (an oracle of its own, without the reference's roundings)
    torch.testing.assert_close(expected.float(), (dense * weights[..., None]).sum(dim=1), atol=5e-2, rtol=5e-2)
    with pytest.raises(ValueError, match="without a gate .* need their activation"):
        fused_moe(x, up, w2, weights, ids, gated=False)
    with pytest.raises(ValueError, match=r"w2 must have shape \[8, 96, 24\]"):
        fused_moe(x, up, w2, weights, ids, activation=relu2)  # read as gate and up halves


@pytest.mark.parametrize("biases", [False, True], ids=["plain", "biases"])
def test_fused_moe_pairs_of_no_expert_here_add_nothing(device: torch.device, biases: bool) -> None:
    """Expert parallelism: a rank holds some experts; a pair routed to id num_experts is
    another rank's and adds nothing (with gpt-oss's biases too): the sum equals the one
    over the pairs this rank serves alone, and a token routed wholly elsewhere gets zeros."""
    num_tokens, num_experts, top_k, hidden, inter = 37, 8, 3, 96, 48
    x, w13, w2 = _inputs((num_tokens, num_experts, top_k, hidden, inter), torch.float32, device)
    weights, ids = _routing(num_tokens, 2 * num_experts, top_k, device, torch.float32)
    local = ids.masked_fill(ids >= num_experts, num_experts)  # experts 8..15 are another rank's
    local[0] = num_experts
    kwargs = dict(w13_bias=torch.randn(num_experts, 2 * inter, device=device),
                  w2_bias=torch.randn(num_experts, hidden, device=device)) if biases else {}
    out = fused_moe(x, w13, w2, weights, local, **kwargs)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out, fused_moe_ref(x, w13, w2, weights, local, **kwargs))
    ours = local < num_experts  # the same sum with the others' pairs weighed zero on our experts
    assert_close(out, fused_moe_ref(x, w13, w2, weights * ours, local.clamp(max=num_experts - 1), **kwargs))


def test_fused_moe_reads_strided_rows(device: torch.device) -> None:
    """x as a slice of a wider buffer, as the residual stream hands it over."""
    x, w13, w2 = _inputs((6, 4, 2, 64, 32), torch.float32, device)
    wide = torch.randn(6, 160, device=device)
    wide[:, 16:80] = x
    weights, ids = _routing(6, 4, 2, device, torch.float32)
    assert_close(fused_moe(wide[:, 16:80], w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))


def test_fused_moe_rejects_what_it_cannot_run(device: torch.device) -> None:
    x, w13, w2 = _inputs((3, 4, 2, 64, 32), torch.float32, device)
    weights, ids = _routing(3, 4, 2, device, torch.float32)
    with pytest.raises(ValueError, match="topk_ids must have dtype in \\(int64\\)"):
        fused_moe(x, w13, w2, weights, ids.int())
    with pytest.raises(ValueError, match=r"w2 must have shape \[4, 64, 32\]"):
        fused_moe(x, w13, w2[:, :, :16], weights, ids)
    with pytest.raises(ValueError, match=r"w13 must have dtype in \(float32, float8_e4m3fn, int8, int32, uint8\)"):
        fused_moe(x, w13.half(), w2, weights, ids)


def _fp8_experts(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [quantize(w[e], block) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


# (case, scale block): 16 x 32 blocks off square; one scale per expert row (per channel)
FP8_CASES = [((37, 8, 3, 96, 48), (16, 32)), ((1, 4, 2, 64, 96), (1, 128))]
if ON_CUDA:
    FP8_CASES += [((512, 64, 8, 2048, 768), (128, 128))]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case, block", FP8_CASES, ids=[str(c) for c in FP8_CASES])
def test_fused_moe_over_fp8_experts_matches_the_dequantized_reference(device, case, block, dtype) -> None:
    x, w13, w2 = _inputs(case, dtype, device)
    (w13, s13), (w2, s2) = _fp8_experts(w13, block), _fp8_experts(w2, block)
    weights, ids = _routing(case[0], case[1], case[2], device, dtype)
    out = fused_moe(x, w13, w2, weights, ids, s13, s2, block)
    assert_close(out, fused_moe_ref(x, w13, w2, weights, ids, s13, s2, block))
    # the scales do bite: each expert's own blocks
    assert not torch.allclose(out.float(), fused_moe_ref(x, w13, w2, weights, ids, s13.flip(0), s2, block).float())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_moe_over_integer_experts_matches_the_dequantized_reference(device, bits, dtype) -> None:
    """int8 experts, and int4 experts packed by compressed-tensors' packer, a scale per group
    of 32 columns; the reference multiplies the unpacked integers."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    case, group = (37, 8, 3, 96, 64), 32
    x, w13, w2 = _inputs(case, dtype, device)
    weights, ids = _routing(case[0], case[1], case[2], device, dtype)
    stored, values, scales = [], [], []
    for w in (w13, w2):
        pairs = [quantize_int(w[e].float().cpu(), bits, group) for e in range(w.shape[0])]
        q = torch.stack([p[0] for p in pairs])
        values.append(q.to(device))
        scales.append(torch.stack([p[1] for p in pairs]).to(device))
        stored.append((pack_to_int32(q, 4) if bits == 4 else q).to(device))
    out = fused_moe(x, stored[0], stored[1], weights, ids, scales[0], scales[1], (1, group))
    assert_close(out, fused_moe_ref(x, values[0], values[1], weights, ids, scales[0], scales[1], (1, group)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_over_mxfp4_experts_matches_the_dequantized_reference(device, dtype) -> None:
    """gpt-oss's MXFP4 experts: every e2m1 code (two to a byte, low nibble first) times a
    power of two per 32 columns; the reference decodes the codes from a table."""
    case = (37, 8, 3, 96, 64)
    x, _, _ = _inputs(case, dtype, device)
    weights, ids = _routing(case[0], case[1], case[2], device, dtype)
    gen = torch.Generator().manual_seed(0)
    w13, w2 = (torch.randint(0, 256, (8, n, k // 2), generator=gen, dtype=torch.uint8).to(device)
               for n, k in ((128, 96), (96, 64)))
    s13, s2 = (torch.randint(127 - 7, 127 - 4, (8, n, k // 32), generator=gen, dtype=torch.uint8).to(device)
               for n, k in ((128, 96), (96, 64)))  # e8m0 exponents: 2^-7 .. 2^-5
    out = fused_moe(x, w13, w2, weights, ids, s13, s2, (1, 32))
    assert_close(out, fused_moe_ref(x, w13, w2, weights, ids, s13, s2, (1, 32)))
    assert not torch.allclose(out.float(), fused_moe_ref(x, w13 ^ 0x88, w2, weights, ids, s13, s2, (1, 32)).float())


def test_fused_moe_over_fp8_experts_needs_their_scales(device: torch.device) -> None:
    x, w13, w2 = _inputs((3, 4, 2, 64, 32), torch.float32, device)
    (w13, s13), (w2, s2) = _fp8_experts(w13, (16, 32)), _fp8_experts(w2, (16, 32))
    weights, ids = _routing(3, 4, 2, device, torch.float32)
    with pytest.raises(ValueError, match=r"w13 is quantized \(torch.float8_e4m3fn\): its scales and their block are needed"):
        fused_moe(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match=r"w2_scale must have shape \[4, 4, 1\]"):
        fused_moe(x, w13, w2, weights, ids, s13, s13, (16, 32))
    with pytest.raises(ValueError, match="w13_scale goes with quantized weights"):
        fused_moe(x, w13.float(), w2.float(), weights, ids, s13, s2, (16, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_over_experts_with_zero_points(device, dtype) -> None:
    """int4 experts with a zero point per group of 32 columns (GPTQ's and AWQ's MoE
    checkpoints): against the dense reference over (q - zero) * scale."""
    case, group = (37, 8, 3, 96, 64), 32
    x, _, _ = _inputs(case, dtype, device)
    weights, ids = _routing(case[0], case[1], case[2], device, dtype)
    parts = []
    for n, k in ((128, 96), (96, 64)):  # w13, w2: each expert its own integers
        experts = [asymmetric_int(n, k, 4, group, seed=e + k) for e in range(8)]
        parts.append([torch.stack(p).to(device) for p in zip(*experts, strict=True)])
    (w13, s13, z13, d13), (w2, s2, z2, d2) = parts
    out = fused_moe(x, w13, w2, weights, ids, s13, s2, (1, group), w13_zero=z13, w2_zero=z2)
    assert_close(out, fused_moe_ref(x, d13.to(dtype), d2.to(dtype), weights, ids))
