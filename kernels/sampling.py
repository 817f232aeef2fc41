"""Top-k / top-p sampling without sorting the vocabulary.

Each row's cut-offs are found by bisection on the logit value instead of a sort: a float's
bits, reordered so that integer order matches float order, are searched, each step one pass
over the row that counts tokens (top-k) or sums their probability (top-p) above the
candidate. The same pass finds the row's nearest logits on either side of the candidate, and
the bracket snaps to them: it shrinks to the logits actually there, so a cut-off among the
few large logits of a row (a small k, a peaked distribution) takes far fewer than the 32
steps of bisecting bits alone. The cut-off is an exact logit of the row, and every token tied
with it is kept. Top-p applies to the top-k set, renormalised (vLLM's order).

The draw is an exponential race: with `noise` i.i.d. Exp(1), `argmax(p_i / noise_i)` over
the kept tokens is distributed as the renormalised p. Taking `noise` as an input keeps the
kernel deterministic: per-request seeds live in the torch generators that fill it.
"""

import torch

from kernels._common import (
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
    next_power_of_2,
    tl,
    triton,
)

__all__ = ["top_k_top_p_sample", "top_k_top_p_sample_ref"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK_V = 2048


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 whose signed order is the float order (-inf lowest)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _mass_at_least(
    row_ptr,  # one row of logits, [vocab_size]
    vocab_size,
    threshold,  # int64 ordered key
    row_max,  # fp32
    COUNT: tl.constexpr,  # count tokens instead of summing exp(x - row_max)
    BLOCK_V: tl.constexpr,
):
    """The mass of the tokens whose key is at least `threshold`; the smallest key among them
    (2**31 - 1 if none) and the largest key below it (-2**31 if none)."""
    total = tl.zeros([BLOCK_V], tl.float32)  # per lane, reduced once at the end
    above = tl.full([BLOCK_V], 2**31 - 1, tl.int32)
    below = tl.full([BLOCK_V], -(2**31), tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        in_row = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        key = _ordered_key(x)
        keep = (key >= threshold) & in_row
        if COUNT:
            total += tl.where(keep, 1.0, 0.0)
        else:
            total += tl.where(keep, tl.exp(x - row_max), 0.0)
        above = tl.minimum(above, tl.where(keep, key, 2**31 - 1))
        below = tl.maximum(below, tl.where(in_row & (key < threshold), key, -(2**31)))
    return tl.sum(total, 0), tl.min(above, 0), tl.max(below, 0)


@triton.jit
def _largest_key_reaching(
    row_ptr,
    vocab_size,
    lo,  # int64 key with mass_at_least(lo) >= target
    hi,  # int64 key, the row's largest
    target,  # fp32
    row_max,
    COUNT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The largest key t in [lo, hi] with mass_at_least(t) >= target (it decreases in t, and
    changes only at the row's keys: t is one of them)."""
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        mass, above, below = _mass_at_least(row_ptr, vocab_size, mid, row_max, COUNT, BLOCK_V)
        ok = mass >= target
        lo = tl.where(ok, above.to(tl.int64), lo)  # no key in [mid, above): the same mass
        hi = tl.where(ok, hi, below.to(tl.int64))  # t < mid is a key: at most the largest below
    return lo


@triton.jit
def _top_k_top_p_sample_kernel(
    logits_ptr,  # [B, vocab_size]
    noise_ptr,  # [B, vocab_size] fp32, Exp(1)
    top_k_ptr,  # [B] int32; <= 0 or >= vocab_size: off
    top_p_ptr,  # [B] fp32; >= 1: off
    out_ptr,  # [B] int64 sampled token ids
    vocab_size,
    stride_logits,
    stride_noise,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits
    row_max = tl.full([], float("-inf"), tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf"))
        row_max = tl.maximum(row_max, tl.max(x.to(tl.float32), 0))
    max_key = _ordered_key(row_max).to(tl.int64)

    threshold = tl.full([], -(2**31), tl.int64)  # below every key: keep all
    top_k = tl.load(top_k_ptr + row)
    if (top_k > 0) & (top_k < vocab_size):
        target = top_k.to(tl.float32)
        threshold = _largest_key_reaching(
            row_ptr, vocab_size, threshold, max_key, target, row_max, True, BLOCK_V
        )
    top_p = tl.load(top_p_ptr + row)
    if top_p < 1.0:
        kept_mass, _, _ = _mass_at_least(row_ptr, vocab_size, threshold, row_max, False, BLOCK_V)
        threshold = _largest_key_reaching(
            row_ptr, vocab_size, threshold, max_key, top_p * kept_mass, row_max, False, BLOCK_V
        )

    best = tl.full([], float("-inf"), tl.float32)
    best_col = tl.full([], 0, tl.int64)
    noise_row = noise_ptr + row * stride_noise
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_row = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        q = tl.load(noise_row + cols, mask=in_row, other=1.0)
        keep = (_ordered_key(x) >= threshold) & in_row
        race = tl.where(keep, x - tl.log(q), float("-inf"))  # [BLOCK_V]: log(p_i / q_i) + c
        chunk_best = tl.max(race, 0)
        chunk_col = start + tl.argmax(race, 0)
        better = chunk_best > best
        best_col = tl.where(better, chunk_col.to(tl.int64), best_col)
        best = tl.where(better, chunk_best, best)
    tl.store(out_ptr + row, best_col)


def _check_inputs(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
) -> None:
    check_dtype("logits", logits, _DTYPES)
    check_shape("logits", logits, (None, None))
    num_rows = logits.shape[0]
    check_shape("noise", noise, tuple(logits.shape))
    check_dtype("noise", noise, (torch.float32,))
    check_shape("top_k", top_k, (num_rows,))
    check_dtype("top_k", top_k, (torch.int32,))
    check_shape("top_p", top_p, (num_rows,))
    check_dtype("top_p", top_p, (torch.float32,))
    for name, t in (("logits", logits), ("noise", noise), ("top_k", top_k), ("top_p", top_p)):
        check_last_dim_contiguous(name, t)


def top_k_top_p_sample(
    logits: torch.Tensor,  # [B, vocab_size], temperature applied; -inf bans a token
    top_k: torch.Tensor,  # [B] int32; <= 0 or >= vocab_size: off
    top_p: torch.Tensor,  # [B] float32 in (0, 1]; 1: off
    noise: torch.Tensor,  # [B, vocab_size] float32, i.i.d. Exp(1)
) -> torch.Tensor:  # [B] int64 token ids
    """Sample one token per row from softmax(logits) restricted by top-k, then top-p.

    Fill `noise` with `torch.empty_like(..).exponential_(generator=g)` (a seeded generator
    per request reproduces its draws). Each row needs at least one finite logit.
    """
    _check_inputs(logits, top_k, top_p, noise)
    check_device(_top_k_top_p_sample_kernel, logits=logits, top_k=top_k, top_p=top_p, noise=noise)
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    block_v = min(next_power_of_2(vocab_size), _MAX_BLOCK_V)
    _top_k_top_p_sample_kernel[(num_rows,)](
        logits, noise, top_k, top_p, out,
        vocab_size, logits.stride(0), noise.stride(0),
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )  # fmt: skip
    return out


def top_k_top_p_sample_ref(
    logits: torch.Tensor,  # [B, vocab_size]
    top_k: torch.Tensor,  # [B] int32
    top_p: torch.Tensor,  # [B] float32
    noise: torch.Tensor,  # [B, vocab_size] float32, Exp(1)
) -> torch.Tensor:  # [B] int64
    """Plain-torch top-k / top-p by sorting, then the same exponential race. As the kernel
    (and vLLM's top-k), each cut-off is a logit of the row and the tokens tied with it stay:
    top-k keeps the logits at least the k-th largest; top-p, within that set, the tokens whose
    strictly larger logits hold less than p of its mass."""
    x = logits.float()
    vocab_size = x.shape[1]
    sorted_x, order = x.sort(dim=-1, descending=True)  # [B, V]
    k = top_k.long()[:, None]
    kth = sorted_x.gather(1, (k.clamp(1, vocab_size) - 1))  # [B, 1]
    top_k_on = (k > 0) & (k < vocab_size)
    keep_sorted = (sorted_x >= kth) | ~top_k_on  # [B, V]
    probs = (sorted_x - sorted_x[:, :1]).exp().double() * keep_sorted  # unnormalised, in float64
    # the mass of the logits strictly larger than each: before the first of its ties
    negated = (-sorted_x).contiguous()  # ascending, for searchsorted
    first_tie = torch.searchsorted(negated, negated)  # [B, V]
    above = (probs.cumsum(dim=-1) - probs).gather(1, first_tie)
    p = top_p.double()[:, None]
    keep_sorted &= (above < p * probs.sum(dim=-1, keepdim=True)) | (p >= 1)
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)  # [B, V]
    race = torch.where(keep, x - noise.log(), float("-inf"))
    return race.argmax(dim=-1)
