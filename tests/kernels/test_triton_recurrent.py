"""The kernels of the layers with a per-request state (a decode's convolution, the gated delta
rule over ragged requests) against their torch references, and the references against transformers' Qwen3.5."""

import pytest
import torch
from kernel_cases import ON_CUDA, assert_close

from kernels import (
    StateSaves,
    causal_conv1d_step,
    causal_conv1d_step_ref,
    gated_delta_scan,
    gated_delta_scan_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# (rows, channels, kernel): Qwen3.5's 4-wide convolution, a 2-wide one, channels past a program
CONV_SHAPES = [(3, 96, 4), (1, 40, 2), (5, 300, 4)]
# (rows, heads, key_dim, value_dim): Qwen3.5's square heads, Mamba2's 64-wide heads over a
# 128-wide state, and sizes that are not powers of two
DELTA_SHAPES = [(3, 2, 16, 32), (2, 3, 24, 40), (1, 2, 128, 64)]
if ON_CUDA:
    CONV_SHAPES += [(256, 8192, 4)]
    DELTA_SHAPES += [(256, 32, 128, 128)]
NUM_SLOTS = 9


def _slots(rows: int, device: torch.device) -> torch.Tensor:
    """Distinct slots in no order, among more than the rows hold."""
    return torch.randperm(max(NUM_SLOTS, rows + 2), device=device)[:rows]


def _layer_view(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's view of a pool of three layers' states [slots, 3, ...]: strided as the model's."""
    return torch.randn(shape[0], 3, *shape[1:], device=device).to(dtype)[:, 1]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", CONV_SHAPES, ids=[str(s) for s in CONV_SHAPES])
def test_causal_conv1d_step(device: torch.device, shape: tuple[int, int, int], bias: bool,
                            dtype: torch.dtype) -> None:
    rows, channels, kernel = shape
    x = torch.randn(rows, channels, device=device).to(dtype)
    slots = _slots(rows, device)
    state = _layer_view((max(NUM_SLOTS, rows + 2), channels, kernel - 1), dtype, device)
    weight = (0.5 * torch.randn(channels, kernel, device=device)).to(dtype)
    b = torch.randn(channels, device=device).to(dtype) if bias else None
    expected_state = state.clone()
    expected = causal_conv1d_step_ref(x, expected_state, slots, weight, b)
    out = causal_conv1d_step(x, state, slots, weight, b)
    assert_close(out, expected)
    torch.testing.assert_close(state, expected_state, atol=0, rtol=0)  # moved, never rounded; other slots kept
    assert torch.equal(state[slots, :, -1], x)


def _scan_inputs(lengths: list[int], heads: int, key_dim: int, value_dim: int, delta: bool, device: torch.device
                 ) -> tuple[torch.Tensor, ...]:
    rows = sum(lengths)
    q, k = (torch.nn.functional.normalize(torch.randn(rows, heads, key_dim, device=device), dim=-1) for _ in "qk")
    v = torch.randn(rows, heads, value_dim, device=device)
    g = -torch.rand(rows, heads, device=device)  # decays in (e^-1, 1]
    beta = torch.rand(rows, heads, device=device) if delta else None
    return q, k, v, g, beta


def _starts(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("delta", [True, False], ids=["delta", "mamba2"])
@pytest.mark.parametrize("shape", DELTA_SHAPES, ids=[str(s) for s in DELTA_SHAPES])
def test_gated_delta_scan_decodes(device: torch.device, shape: tuple[int, int, int, int], delta: bool) -> None:
    """A row per request, as a step's decodes run (and a decode graph's)."""
    rows, heads, key_dim, value_dim = shape
    args = _scan_inputs([1] * rows, heads, key_dim, value_dim, delta, device)
    slots = _slots(rows, device)
    state = _layer_view((max(NUM_SLOTS, rows + 2), heads, key_dim, value_dim), torch.float32, device)
    expected_state = state.clone()
    starts = _starts([1] * rows, device)
    expected = gated_delta_scan_ref(*args, expected_state, slots, starts)
    out = gated_delta_scan(*args, state, slots, starts)
    assert_close(out, expected)
    assert_close(state, expected_state)
    kept = torch.ones(len(state), dtype=torch.bool, device=device)
    kept[slots] = False
    torch.testing.assert_close(state[kept], expected_state[kept], atol=0, rtol=0)  # other slots untouched


@pytest.mark.parametrize("delta", [True, False], ids=["delta", "mamba2"])
def test_gated_delta_scan_prefills_and_saves(device: torch.device, delta: bool) -> None:
    """Ragged requests (decodes among prefill chunks) through the rule a token at a time, with
    states saved after some rows: two at one row, one after the last row, a request saving none."""
    lengths = [1, 9, 1, 20, 6]
    heads, key_dim, value_dim = 2, 16, 24
    args = _scan_inputs(lengths, heads, key_dim, value_dim, delta, device)
    slots = _slots(len(lengths), device)
    state = _layer_view((NUM_SLOTS, heads, key_dim, value_dim), torch.float32, device)
    starts = _starts(lengths, device)
    # (request, rows before the save): the first decode's, two after row 4 of the first prefill,
    # rows 16 and 20 of the second (its end), one of the third; the second decode saves nothing
    where = [(0, 1), (1, 4), (1, 4), (3, 16), (3, 20), (4, 5)]
    index = torch.tensor([sum(r < i for r, _ in where) for i in range(len(lengths) + 1)], dtype=torch.int32,
                         device=device)
    saves = StateSaves(torch.full((8, heads, key_dim, value_dim), float("nan"), device=device), index,
                       torch.tensor([n for _, n in where], dtype=torch.int32, device=device),
                       torch.tensor([5, 0, 7, 3, 6, 1], device=device))
    expected_state = state.clone()
    expected_saves = StateSaves(saves.saved.clone(), saves.index, saves.after, saves.slots)
    expected = gated_delta_scan_ref(*args, expected_state, slots, starts, expected_saves)
    out = gated_delta_scan(*args, state, slots, starts, saves)
    assert_close(out, expected)
    assert_close(state, expected_state)
    written = saves.slots
    assert_close(saves.saved[written], expected_saves.saved[written])
    assert saves.saved[[2, 4]].isnan().all()  # slots no save names are untouched
    assert_close(saves.saved[6], state[slots[3]])  # the save after a request's last row: its final state


def test_gated_delta_scan_takes_strided_heads(device: torch.device) -> None:
    """q, k and v sliced out of a wider row (each head's features still contiguous)."""
    lengths, heads, dim = [3, 1], 3, 16
    wide = torch.randn(sum(lengths), heads, 3 * dim, device=device)
    q, k, v = wide.split(dim, dim=-1)
    g, beta = -torch.rand(sum(lengths), heads, device=device), torch.rand(sum(lengths), heads, device=device)
    slots, starts = _slots(len(lengths), device), _starts(lengths, device)
    state = torch.randn(NUM_SLOTS, heads, dim, dim, device=device)
    expected_state = state.clone()
    expected = gated_delta_scan_ref(q, k, v, g, beta, expected_state, slots, starts)
    assert_close(gated_delta_scan(q, k, v, g, beta, state, slots, starts), expected)
    assert_close(state, expected_state)


def test_references_match_transformers() -> None:
    """Qwen3.5 in transformers: its convolution update (SiLU) for a decode, and its recurrent
    gated delta rule (q scaled by key_dim ** -0.5 inside) over a few tokens, from the same states."""
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    rows, channels, kernel = 3, 24, 4
    x = torch.randn(rows, channels)
    slots = torch.tensor([4, 0, 2])
    conv_state = torch.randn(5, channels, kernel - 1)
    weight, bias = torch.randn(channels, kernel), torch.randn(channels)
    theirs_state = conv_state[slots].clone()
    theirs = qwen.causal_conv1d_update(x[:, :, None], theirs_state, weight, bias, activation="silu")[:, :, 0]
    torch.testing.assert_close(causal_conv1d_step_ref(x, conv_state, slots, weight, bias), theirs)
    torch.testing.assert_close(conv_state[slots], theirs_state)

    heads, key_dim, value_dim, tokens = 2, 16, 8, 5  # each request 5 tokens
    q, k, v, g, beta = _scan_inputs([tokens] * rows, heads, key_dim, value_dim, True, torch.device("cpu"))
    state = torch.randn(5, heads, key_dim, value_dim)
    theirs, final = qwen.torch_recurrent_gated_delta_rule(
        *(t.view(rows, tokens, *t.shape[1:]) for t in (q, k, v, g, beta)), initial_state=state[slots].clone(),
        output_final_state=True)
    ours = gated_delta_scan_ref(q * key_dim**-0.5, k, v, g, beta, state, slots,
                                _starts([tokens] * rows, torch.device("cpu")))
    torch.testing.assert_close(ours, theirs.reshape(ours.shape))
    torch.testing.assert_close(state[slots], final)


@pytest.mark.parametrize(
    "change, message",
    [
        ("state_dtype", "conv_state must have dtype"),
        ("weight_shape", "weight must have shape"),
        ("slots_dtype", "slots must have dtype"),
        ("slots_len", "slots must have shape"),
    ],
)
def test_conv_launcher_rejects_bad_inputs(device: torch.device, change: str, message: str) -> None:
    x = torch.randn(2, 8, device=device)
    state, weight, slots = torch.randn(4, 8, 3, device=device), torch.randn(8, 4, device=device), torch.tensor(
        [1, 3], device=device)
    if change == "state_dtype":
        state = state.half()
    elif change == "weight_shape":
        weight = weight[:4]
    elif change == "slots_dtype":
        slots = slots.int()
    elif change == "slots_len":
        slots = slots[:1]
    with pytest.raises(ValueError, match=message):
        causal_conv1d_step(x, state, slots, weight)


@pytest.mark.parametrize(
    "change, message",
    [
        ("q_dtype", "q must have dtype"),
        ("state_shape", "state must have shape"),
        ("beta_shape", "beta must have shape"),
        ("v_stride", "v must have a contiguous last dimension"),
        ("starts_dtype", "starts must have dtype"),
        ("save_after_dtype", "saves.after must have dtype"),
    ],
)
def test_delta_launcher_rejects_bad_inputs(device: torch.device, change: str, message: str) -> None:
    q, k, v = (torch.randn(2, 2, 8, device=device) for _ in range(3))
    g, beta = torch.randn(2, 2, device=device), torch.rand(2, 2, device=device)
    state, slots = torch.randn(4, 2, 8, 8, device=device), torch.tensor([1, 3], device=device)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    saves = StateSaves(state.clone(), starts, torch.ones(1, dtype=torch.int32, device=device), slots[:1])
    if change == "q_dtype":
        q = q.half()
    elif change == "state_shape":
        state = state[:, :1]
    elif change == "beta_shape":
        beta = beta[:1]
    elif change == "v_stride":
        v = torch.randn(2, 2, 16, device=device)[..., ::2]
    elif change == "starts_dtype":
        starts = starts.long()
    elif change == "save_after_dtype":
        saves = StateSaves(saves.saved, saves.index, saves.after.long(), saves.slots)
    with pytest.raises(ValueError, match=message):
        gated_delta_scan(q, k, v, g, beta, state, slots, starts, saves)
