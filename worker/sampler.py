"""Sampler: one step's logits for every scheduled request in, one next token per request out.

A single vectorised pass over the batch, in vLLM's order:

    allowed_token_ids -> min_tokens -> logit_bias -> penalties -> temperature -> [logprobs]
    -> top-k -> top-p -> min-p -> sample

Logprobs are reported "processed" (as the issue asks, and as vLLM's processed-logprobs mode
does): the log-softmax of the logits after every step up to temperature, before the
top-k/top-p/min-p filters, so a reported distribution is the one the filters started from.
Greedy rows (temperature 0) take the argmax of the penalised logits and report the
log-softmax of those logits (no temperature to divide by).

Random rows sample with the exponential race: argmax(probs / E) with E ~ Exponential(1) drawn
independently per token picks token i with probability probs[i]. Each row's draw depends on its
own noise only, so a seeded request that draws its noise from its own `torch.Generator`
reproduces its tokens whatever else is in the batch and in whatever order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from producer.sampling_params import MIN_TEMPERATURE, SamplingParams

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


@dataclass
class SamplingBatch:
    """Per-row sampling state of one engine step, as tensors on the logits' device.

    Optional tensors are None when no row in the batch uses the feature, so the sampler skips
    its work entirely.
    """

    temperature: Tensor  # [num_seqs] float32; 1.0 on greedy rows so dividing is always safe
    greedy: Tensor  # [num_seqs] bool
    all_greedy: bool
    any_greedy: bool
    top_k: Tensor | None  # [num_seqs] int64 in [1, vocab]; vocab where off
    top_p: Tensor | None  # [num_seqs] float32 in (0, 1]; 1.0 where off
    min_p: Tensor | None  # [num_seqs] float32 in [0, 1]; 0.0 where off
    repetition_penalty: Tensor | None  # [num_seqs] float32; 1.0 where off
    seen_mask: Tensor | None  # [num_seqs, vocab] bool: token occurs in prompt or output
    frequency_penalty: Tensor | None  # [num_seqs] float32
    presence_penalty: Tensor | None  # [num_seqs] float32
    output_counts: Tensor | None  # [num_seqs, vocab] float32: occurrences in the output
    blocked_rows: Tensor | None  # [num_blocked] int64 } (row, token) pairs masked to -inf
    blocked_token_ids: Tensor | None  # [num_blocked] int64 } while output < min_tokens
    disallowed: Tensor | None  # [num_seqs, vocab] bool: outside a row's allowed_token_ids
    bias_rows: Tensor | None  # [num_biased] int64 } logit_bias: value added at (row, token)
    bias_token_ids: Tensor | None  # [num_biased] int64 }
    bias_values: Tensor | None  # [num_biased] float32 }
    # (row, its generator) for seeded random rows; other random rows use the sampler's own
    row_generators: list[tuple[int, torch.Generator]]
    num_logprobs: list[int | None]  # per row: how many alternatives to report

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device,
        token_masks: list[bytes | None] | None = None,
    ) -> SamplingBatch:
        """Gather the sampling state of `params[i]` (request i = row i) into tensors.

        `eos_token_ids` is the model's set of EOS ids; it applies to every row (a per-row
        list of identical ids works too). `generators[i]` is request i's own generator when it
        has a seed, kept by the engine across steps. Cost is O(num_seqs) plus, only when some
        row uses penalties, O(prompt + output tokens) to count tokens. `token_masks[i]`, when
        not None, allows request i only the tokens whose byte is 1 (guided decoding).
        """
        _check_rows(len(params), prompt_token_ids, output_token_ids, generators)
        greedy = [p.temperature < MIN_TEMPERATURE for p in params]
        temperature = [
            1.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)
        ]
        return cls(
            temperature=_row_tensor(temperature, torch.float32, device),
            greedy=_row_tensor(greedy, torch.bool, device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            **_filter_tensors(params, greedy, vocab_size, device),
            **_penalty_tensors(params, prompt_token_ids, output_token_ids, vocab_size, device),
            **_min_tokens_blocks(params, output_token_ids, eos_token_ids, vocab_size, device),
            **_token_list_tensors(params, token_masks, eos_token_ids, vocab_size, device),
            row_generators=[
                (row, g)
                for row, (g, is_greedy) in enumerate(zip(generators, greedy, strict=True))
                if g is not None and not is_greedy
            ],
            num_logprobs=[p.logprobs for p in params],
        )


def _check_rows(
    num_seqs: int,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
) -> None:
    for name, rows in (
        ("prompt_token_ids", prompt_token_ids),
        ("output_token_ids", output_token_ids),
        ("generators", generators),
    ):
        if len(rows) != num_seqs:
            raise ValueError(f"{name} has {len(rows)} rows, expected {num_seqs}")


def _row_tensor(
    values: Sequence[float | int | bool], dtype: torch.dtype, device: torch.device
) -> Tensor:
    return torch.tensor(values, dtype=dtype).to(device)


def _filter_tensors(
    params: list[SamplingParams], greedy: list[bool], vocab_size: int, device: torch.device
) -> dict[str, Tensor | None]:
    # Filters only matter on random rows; an all-greedy batch or one where no random row
    # filters skips the sort.
    random_rows = [p for p, g in zip(params, greedy, strict=True) if not g]
    top_k = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
    use_top_k = any(0 < p.top_k < vocab_size for p in random_rows)
    use_top_p = any(p.top_p < 1.0 for p in random_rows)
    use_min_p = any(p.min_p > 0.0 for p in random_rows)
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    return {
        "top_k": _row_tensor(top_k, torch.int64, device) if use_top_k else None,
        "top_p": _row_tensor(top_p, torch.float32, device) if use_top_p else None,
        "min_p": _row_tensor(min_p, torch.float32, device) if use_min_p else None,
    }


def _penalty_tensors(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> dict[str, Tensor | None]:
    out: dict[str, Tensor | None] = dict.fromkeys(
        (
            "repetition_penalty",
            "seen_mask",
            "frequency_penalty",
            "presence_penalty",
            "output_counts",
        )
    )
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = [
            list(prompt) + list(output)
            for prompt, output in zip(prompt_token_ids, output_token_ids, strict=True)
        ]
        out["repetition_penalty"] = _row_tensor(
            [p.repetition_penalty for p in params], torch.float32, device
        )
        out["seen_mask"] = _token_counts(seen, vocab_size, device) > 0
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        out["frequency_penalty"] = _row_tensor(
            [p.frequency_penalty for p in params], torch.float32, device
        )
        out["presence_penalty"] = _row_tensor(
            [p.presence_penalty for p in params], torch.float32, device
        )
        out["output_counts"] = _token_counts(output_token_ids, vocab_size, device)
    return out


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[num_seqs, vocab_size] float32: how often each token occurs in each row.

    Ids at or above vocab_size (an embedding table larger than the logits) can never be sampled,
    so they are not counted, as transformers' repetition penalty does.
    """
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)  # [num_tokens]
    cols = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64)
    in_vocab = cols < vocab_size
    rows, cols = rows[in_vocab].to(device), cols[in_vocab].to(device)
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    ones = torch.ones_like(cols, dtype=torch.float32)
    return counts.index_put_((rows, cols), ones, accumulate=True)


def _min_tokens_blocks(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: list[int],
    vocab_size: int,
    device: torch.device,
) -> dict[str, Tensor | None]:
    """(row, token) pairs that may not be sampled yet: the stop ids of rows short of min_tokens.

    As in vLLM, the stop ids are `stop_token_ids` plus EOS unless `ignore_eos` (then EOS does
    not end the request, so there is nothing to hold off). Ids outside the logits' vocabulary
    can never be sampled and are dropped.
    """
    rows: list[int] = []
    cols: list[int] = []
    for row, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
        if len(output) >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        for token_id in sorted(t for t in stop_ids if t < vocab_size):
            rows.append(row)
            cols.append(token_id)
    if not rows:
        return {"blocked_rows": None, "blocked_token_ids": None}
    return {
        "blocked_rows": _row_tensor(rows, torch.int64, device),
        "blocked_token_ids": _row_tensor(cols, torch.int64, device),
    }


def _token_list_tensors(
    params: list[SamplingParams], token_masks: list[bytes | None] | None, eos_token_ids: list[int],
    vocab_size: int, device: torch.device,
) -> dict[str, Tensor | None]:
    """allowed_token_ids and guided-decoding masks as one mask, logit_bias as (row, token,
    value) triples; the engine has checked that every id is in the vocabulary."""
    out: dict[str, Tensor | None] = dict.fromkeys(
        ("disallowed", "bias_rows", "bias_token_ids", "bias_values")
    )
    allowed = [(row, p.allowed_token_ids) for row, p in enumerate(params) if p.allowed_token_ids]
    guided = [(row, m) for row, m in enumerate(token_masks or []) if m is not None]
    if allowed or guided:
        disallowed = torch.zeros(len(params), vocab_size, dtype=torch.bool)
        for row, allowed_ids in allowed:
            disallowed[row] = True
            disallowed[row, allowed_ids] = False
        for row, mask in guided:  # ids past the tokenizer's (padded logits) are never allowed
            permitted = torch.zeros(vocab_size, dtype=torch.bool)
            n = min(len(mask), vocab_size)
            permitted[:n] = torch.frombuffer(bytearray(mask[:n]), dtype=torch.uint8).bool()
            disallowed[row] |= ~permitted
        # allowed_token_ids and a grammar with nothing in common: the row ends (EOS) rather
        # than sampling from nothing
        stuck = disallowed.all(dim=1).nonzero().flatten().tolist()
        for row in stuck:
            disallowed[row, [t for t in eos_token_ids if t < vocab_size]] = False
        out["disallowed"] = disallowed.to(device)
    biased = [(row, t, v) for row, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
    if biased:
        rows, biased_ids, values = zip(*biased, strict=True)
        out["bias_rows"] = _row_tensor(rows, torch.int64, device)
        out["bias_token_ids"] = _row_tensor(biased_ids, torch.int64, device)
        out["bias_values"] = _row_tensor(values, torch.float32, device)
    return out


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


class Sampler:
    """Samples one token per row; unseeded rows draw from a generator seeded with `seed`.

    With `use_kernel` (the CUDA path) top-k / top-p run in one Triton kernel that bisects on
    the logit value instead of sorting the vocabulary; it draws with the same noise, so the
    tokens are those of the torch path. Batches with min_p keep the torch path.
    """

    def __init__(self, seed: int = 0, use_kernel: bool = False) -> None:
        self.seed = seed
        self.use_kernel = use_kernel
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [num_seqs, vocab], any float dtype; row i belongs to the batch's request i."""
        if logits.dim() != 2 or logits.shape[0] != batch.temperature.shape[0]:
            num_seqs = batch.temperature.shape[0]
            raise ValueError(f"logits must be [{num_seqs}, vocab], got {tuple(logits.shape)}")
        logits = apply_allowed_token_ids(logits.float(), batch)  # [num_seqs, vocab] float32
        logits = apply_min_tokens(logits, batch)
        logits = apply_logit_bias(logits, batch)
        logits = apply_penalties(logits, batch)
        # Greedy rows divide by 1; an all-greedy batch skips the full-vocabulary division.
        scaled = logits if batch.all_greedy else logits / batch.temperature.unsqueeze(1)
        token_ids = self._sample(logits, scaled, batch)  # [num_seqs] int64
        return SamplerOutput(
            token_ids=token_ids.tolist(), logprobs=compute_logprobs(scaled, token_ids, batch)
        )

    def _sample(self, logits: Tensor, scaled: Tensor, batch: SamplingBatch) -> Tensor:
        greedy_ids = logits.argmax(dim=-1) if batch.any_greedy else None  # [num_seqs]
        if batch.all_greedy:
            assert greedy_ids is not None
            return greedy_ids
        if self.use_kernel and batch.min_p is None:
            sampled = self._sample_kernel(scaled, batch)
        else:
            filtered = apply_min_p(apply_top_k_top_p(scaled, batch.top_k, batch.top_p), batch.min_p)
            probs = filtered.softmax(dim=-1)  # [num_seqs, vocab]
            noise = self._exponential_noise(probs, batch)  # [num_seqs, vocab]
            sampled = (probs / noise).argmax(dim=-1)
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
    scaled: Tensor, token_ids: Tensor, batch: SamplingBatch
) -> list[TokenLogprobs | None] | None:
    """Logprobs of the sampled tokens and the top alternatives, for rows that asked.

    scaled: [num_seqs, vocab] logits after min_tokens, penalties and temperature.
    token_ids: [num_seqs] the sampled tokens.
    """
    rows = [row for row, n in enumerate(batch.num_logprobs) if n is not None]
    if not rows:
        return None
    index = torch.tensor(rows, device=scaled.device)
    logprobs = scaled[index].log_softmax(dim=-1)  # [num_rows, vocab]
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
