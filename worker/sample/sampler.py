"""Sampler: one step's logits for every scheduled request in, one next token per request out.

A single vectorised pass over the batch, in vLLM's order:

    allowed_token_ids -> min_tokens -> logit_bias -> penalties -> temperature -> [logprobs]
    -> top-k -> top-p -> min-p -> sample

Logprobs are reported "processed" by default (as the issue asks; vLLM's logprobs_mode
"processed_logprobs"): the log-softmax of the logits after every step up to temperature,
before the top-k/top-p/min-p filters, so a reported distribution is the one the filters
started from. Greedy rows (temperature 0) take the argmax of the penalised logits and report
the log-softmax of those logits (no temperature to divide by). vLLM's other modes report the
model's own distribution ("raw_logprobs": before any processing, custom logits processors
included), or logits instead of logprobs ("raw_logits", "processed_logits"). A sampler made
`before_temperature` reports processed values before the temperature (Whisper's, whose
decoders weigh a sampled reply by the model's own likelihood of it, its rules applied).

Random rows sample with the exponential race: argmax(probs / E) with E ~ Exponential(1) drawn
independently per token picks token i with probability probs[i]. Each row's draw depends on its
own noise only, so a seeded request that draws its noise from its own `torch.Generator`
reproduces its tokens whatever else is in the batch and in whatever order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from worker.config import LOGPROBS_MODES
from worker.sample.sampling_batch import SamplingBatch

# Smallest positive float32: exponential noise clamped to it never divides by zero.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class TokenLogprobs:
    """Logprobs reported for one generated token, for a request that set `logprobs`."""

    token_id: int  # the sampled token
    logprob: float  # its logprob
    rank: int  # 1 + number of tokens strictly more likely than it
    top_logprobs: dict[int, float]  # the `logprobs` most likely tokens (may hold the sampled one)
    # token id -> its text decoded alone, for the sampled and the top tokens (the output
    # processor fills it; vLLM's Logprob.decoded_token)
    decoded: dict[int, str] = field(default_factory=dict)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row
    # per row (None where the request did not ask); None altogether when no row asked
    logprobs: list[TokenLogprobs | None] | None


def apply_allowed_token_ids(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """logits [num_seqs, vocab] with tokens outside a row's allowed_token_ids at -inf."""
    if batch.disallowed is None:
        return logits
    return logits.masked_fill(batch.disallowed, float("-inf"))


def apply_logit_bias(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """logits [num_seqs, vocab] plus each row's logit_bias (a new tensor)."""
    if batch.bias_rows is None or batch.bias_token_ids is None or batch.bias_values is None:
        return logits
    return logits.index_put((batch.bias_rows, batch.bias_token_ids), batch.bias_values, accumulate=True)


def apply_min_tokens(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """logits [num_seqs, vocab] with stop ids of rows short of min_tokens at -inf (a new tensor)."""
    if batch.blocked_rows is None or batch.blocked_token_ids is None:
        return logits
    blocked = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((batch.blocked_rows, batch.blocked_token_ids), blocked)


def end_rows_with_nothing_left(masked: Tensor, raw: Tensor, batch: SamplingBatch) -> Tensor:
    """A row whose masks leave it nothing (allowed_token_ids and a grammar with nothing in
    common; min_tokens blocking the only tokens they allow) may only end: its EOS tokens get
    their logits back. Sampling from nothing would give NaN and an arbitrary token."""
    if batch.disallowed is None or batch.eos_token_ids is None:
        return masked
    nothing_left = torch.isneginf(masked).all(dim=-1)  # [num_seqs]
    if not nothing_left.any():
        return masked
    ends = torch.full_like(masked, float("-inf"))
    ends[:, batch.eos_token_ids] = raw[:, batch.eos_token_ids]
    return torch.where(nothing_left.unsqueeze(1), ends, masked)


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition (HF/vLLM), then frequency and presence (OpenAI/vLLM) penalties.

    Repetition penalty covers prompt and output tokens: positive logits are divided by it,
    negative ones multiplied, so it always makes a seen token less likely. Frequency and
    presence penalties cover output tokens only:
    logit -= frequency * count + presence * (count > 0).
    """
    if batch.repetition_penalty is not None and batch.seen_mask is not None:
        penalty = batch.repetition_penalty.unsqueeze(1)  # [num_seqs, 1]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(batch.seen_mask, penalised, logits)
    if batch.output_counts is not None and batch.frequency_penalty is not None:
        assert batch.presence_penalty is not None
        counts = batch.output_counts  # [num_seqs, vocab]
        logits = (
            logits
            - batch.frequency_penalty.unsqueeze(1) * counts
            - batch.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
        )
    return logits


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Mask logits [num_seqs, vocab] outside each row's top-k, then outside its top-p nucleus.

    One sort for the whole batch. Top-k keeps ties with the k-th logit (as transformers does);
    top-p keeps the smallest set of most likely tokens whose mass reaches p (always >= 1 token).
    """
    if top_k is None and top_p is None:
        return logits
    # [num_seqs, vocab] each; stable, so ties order the same whatever the rest of the batch
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))  # [num_seqs, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        # Rows with p == 1 are left alone: float rounding can push the cumulative sum to 1
        # before the tail ends, which would drop tokens the request did not ask to drop.
        remove = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor | None) -> Tensor:
    """Mask tokens whose probability is below min_p times the row's highest probability."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)  # [num_seqs, vocab]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [num_seqs, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


# Columns a block in first_argmax: 48 blocks for a 49,152-token vocabulary
_ARGMAX_BLOCK = 1024


def first_argmax(x: Tensor) -> Tensor:
    """x.argmax(dim=-1) for x [num_seqs, vocab]: the same indices (the first of equal maxima; a
    row's first NaN where it has one), found faster on the CPU. There torch's argmax carries an
    index through every comparison (3.4 ms for 128 x 49,152 float32 on one core) where amax is
    vectorised (0.45 ms): so each block of columns' max, then the row's first block holding the
    row's max, then argmax within that block alone. NaN anywhere: argmax itself."""
    num_seqs, vocab = x.shape
    if x.device.type != "cpu" or vocab < 4 * _ARGMAX_BLOCK or x.stride(-1) != 1 or not x.is_floating_point():
        return x.argmax(dim=-1)
    num_blocks = vocab // _ARGMAX_BLOCK
    whole = num_blocks * _ARGMAX_BLOCK
    block_max = x[:, :whole].view(num_seqs, num_blocks, _ARGMAX_BLOCK).amax(dim=-1)  # [num_seqs, num_blocks]
    if whole < vocab:  # the last columns, a shorter block
        block_max = torch.cat([block_max, x[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    row_max = block_max.amax(dim=-1, keepdim=True)  # [num_seqs, 1]
    if row_max.isnan().any():
        return x.argmax(dim=-1)
    first_block = (block_max == row_max).to(torch.uint8).argmax(dim=-1)  # [num_seqs]
    # the block's columns; the last block's beyond the vocabulary repeat its last column,
    # after it, so they never come first
    offsets = torch.arange(_ARGMAX_BLOCK, device=x.device)
    columns = (first_block.unsqueeze(1) * _ARGMAX_BLOCK + offsets).clamp_(max=vocab - 1)  # [num_seqs, block]
    within = x.gather(1, columns).argmax(dim=-1, keepdim=True)  # [num_seqs, 1]
    return columns.gather(1, within).squeeze(1)


class Sampler:
    """Samples one token per row; unseeded rows draw from a generator seeded with `seed`.

    With `use_kernel` (the CUDA path) top-k / top-p run in one Triton kernel that bisects on
    the logit value instead of sorting the vocabulary; it draws with the same noise, so the
    tokens are those of the torch path. Batches with min_p keep the torch path.
    """

    def __init__(self, seed: int = 0, use_kernel: bool = False, logprobs_mode: str = "processed_logprobs",
                 before_temperature: bool = False) -> None:
        self.seed = seed
        self.use_kernel = use_kernel
        self.before_temperature = before_temperature
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self._generators: dict[torch.device, torch.Generator] = {}

    @property
    def reports_raw(self) -> bool:
        """Logprobs come from the model's logits, before any processing."""
        return self.logprobs_mode.startswith("raw")

    def __call__(self, logits: Tensor, batch: SamplingBatch, model_logits: Tensor | None = None) -> SamplerOutput:
        """logits: [num_seqs, vocab], any float dtype; row i belongs to the batch's request i.
        `model_logits`: the model's own where `logits` were processed before (custom logits
        processors), for the raw logprobs modes."""
        if logits.dim() != 2 or logits.shape[0] != batch.temperature.shape[0]:
            num_seqs = batch.temperature.shape[0]
            raise ValueError(f"logits must be [{num_seqs}, vocab], got {tuple(logits.shape)}")
        raw = logits.float()  # [num_seqs, vocab]
        masked = apply_min_tokens(apply_allowed_token_ids(raw, batch), batch)
        logits = end_rows_with_nothing_left(masked, raw, batch)
        logits = apply_logit_bias(logits, batch)
        logits = apply_penalties(logits, batch)
        # Greedy rows divide by 1; an all-greedy batch skips the full-vocabulary division.
        scaled = logits if batch.all_greedy else logits / batch.temperature.unsqueeze(1)
        token_ids = self._sample(logits, scaled, batch)  # [num_seqs] int64
        if self.reports_raw:
            reported = raw if model_logits is None else model_logits.float()
        else:
            reported = logits if self.before_temperature else scaled
        as_logits = self.logprobs_mode.endswith("logits")
        return SamplerOutput(
            token_ids=token_ids.tolist(), logprobs=compute_logprobs(reported, token_ids, batch, as_logits)
        )

    def _sample(self, logits: Tensor, scaled: Tensor, batch: SamplingBatch) -> Tensor:
        greedy_ids = first_argmax(logits) if batch.any_greedy else None  # [num_seqs]
        if batch.all_greedy:
            assert greedy_ids is not None
            return greedy_ids
        if self.use_kernel and batch.min_p is None:
            sampled = self._sample_kernel(scaled, batch)
        else:
            filtered = apply_min_p(apply_top_k_top_p(scaled, batch.top_k, batch.top_p), batch.min_p)
            probs = filtered.softmax(dim=-1)  # [num_seqs, vocab]
            noise = self._exponential_noise(probs, batch)  # [num_seqs, vocab]
            sampled = first_argmax(probs / noise)
        if greedy_ids is None:
            return sampled
        return torch.where(batch.greedy, greedy_ids, sampled)

    def _sample_kernel(self, scaled: Tensor, batch: SamplingBatch) -> Tensor:  # [num_seqs] int64
        import kernels  # triton is loaded only where the kernel path runs

        num_seqs, vocab_size = scaled.shape
        top_k = batch.top_k if batch.top_k is not None else torch.zeros(num_seqs, device=scaled.device)
        top_p = batch.top_p if batch.top_p is not None else torch.ones(num_seqs, device=scaled.device)
        noise = self._exponential_noise(scaled, batch)  # [num_seqs, vocab], the torch path's draws
        return kernels.top_k_top_p_sample(scaled, top_k.int(), top_p, noise)

    def _exponential_noise(self, probs: Tensor, batch: SamplingBatch) -> Tensor:
        """Exponential(1) noise shaped like probs; seeded random rows draw theirs from their own
        generator (the only per-row loop: a draw needs one generator at a time)."""
        noise = torch.empty_like(probs).exponential_(generator=self._generator(probs.device))
        for row, generator in batch.row_generators:
            row_noise = torch.empty(probs.shape[1], device=generator.device)
            noise[row] = row_noise.exponential_(generator=generator).to(probs.device)
        return noise.clamp_(min=_TINY)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]


def compute_logprobs(
    scaled: Tensor, token_ids: Tensor, batch: SamplingBatch, as_logits: bool = False
) -> list[TokenLogprobs | None] | None:
    """Logprobs of the sampled tokens and the top alternatives, for rows that asked.

    scaled: [num_seqs, vocab] logits after min_tokens, penalties and temperature (or the
    model's own, for the raw modes); `as_logits`: report these values, not their log-softmax.
    token_ids: [num_seqs] the sampled tokens.
    """
    rows = [row for row, n in enumerate(batch.num_logprobs) if n is not None]
    if not rows:
        return None
    index = torch.tensor(rows, device=scaled.device)
    logprobs = scaled[index] if as_logits else scaled[index].log_softmax(dim=-1)  # [num_rows, vocab]
    sampled = token_ids[index].unsqueeze(1)  # [num_rows, 1]
    sampled_logprobs = logprobs.gather(1, sampled)  # [num_rows, 1]
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1  # [num_rows]
    max_k = min(max(batch.num_logprobs[row] or 0 for row in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(max_k, dim=-1)  # [num_rows, max_k]
    result: list[TokenLogprobs | None] = [None] * len(batch.num_logprobs)
    columns = zip(
        rows,
        sampled.squeeze(1).tolist(),
        sampled_logprobs.squeeze(1).tolist(),
        ranks.tolist(),
        top_ids.tolist(),
        top_values.tolist(),
        strict=True,
    )
    # Building Python objects per row is unavoidable; the arithmetic above is batched.
    for row, token_id, value, rank, ids, values in columns:
        k = batch.num_logprobs[row] or 0
        result[row] = TokenLogprobs(
            token_id, value, rank, dict(zip(ids[:k], values[:k], strict=True))
        )
    return result
