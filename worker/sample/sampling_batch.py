"""The per-row sampling state of one engine step, as tensors the sampler applies: temperatures
and filters, penalty counts, the (row, token) pairs that min_tokens blocks, allowed-token and
guided-decoding masks, logit_bias. Built once per step from the requests' SamplingParams.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from producer.sampling_params import MIN_TEMPERATURE, SamplingParams


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
    eos_token_ids: Tensor | None  # [num_eos] int64, with disallowed: how a row left nothing ends
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
        token_masks: Tensor | None = None,
        banned_token_ids: list[list[int]] | None = None,
        forced_token_ids: list[int | None] | None = None,
    ) -> SamplingBatch:
        """Gather the sampling state of `params[i]` (request i = row i) into tensors.

        `eos_token_ids` is the model's set of EOS ids; it applies to every row (a per-row
        list of identical ids works too). `generators[i]` is request i's own generator when it
        has a seed, kept by the engine across steps. Cost is O(num_seqs) plus, only when some
        row uses penalties, O(prompt + output tokens) to count tokens. `token_masks`, when
        not None, is guided decoding's bitmask [num_seqs, ceil(vocab / 32)] int32: request i
        may sample token t only where bit t % 32 of word t // 32 of its row is set;
        `banned_token_ids[i]` are tokens request i may not sample this step (bad words);
        `forced_token_ids[i]`, when not None, is the one token request i may sample (a spent
        thinking budget's end marker).
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
            **_blocks(params, output_token_ids, eos_token_ids, vocab_size, device, banned_token_ids),
            **_token_list_tensors(params, token_masks, eos_token_ids, vocab_size, device, forced_token_ids),
            row_generators=[
                (row, g)
                for row, (g, is_greedy) in enumerate(zip(generators, greedy, strict=True))
                if g is not None and not is_greedy
            ],
            num_logprobs=[p.logprobs for p in params],
        )


    def with_masks(self, token_masks: Tensor) -> SamplingBatch:
        """This batch for a step where only its guided rows' masks moved (a batch built with
        masks, and no allowed_token_ids or forced token: those share `disallowed`)."""
        assert self.disallowed is not None and self.eos_token_ids is not None, "built without masks"
        return replace(self, disallowed=refused_by_bitmask(token_masks.to(self.disallowed.device),
                                                           self.disallowed.shape[1]))

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
    out: dict[str, Tensor | None] = {"top_k": None, "top_p": None, "min_p": None}
    if any(0 < p.top_k < vocab_size for p in random_rows):
        top_k = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        out["top_k"] = _row_tensor(top_k, torch.int64, device)
    if any(p.top_p < 1.0 for p in random_rows):
        out["top_p"] = _row_tensor([p.top_p for p in params], torch.float32, device)
    if any(p.min_p > 0.0 for p in random_rows):
        out["min_p"] = _row_tensor([p.min_p for p in params], torch.float32, device)
    return out


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


def _blocks(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: list[int],
    vocab_size: int,
    device: torch.device,
    banned_token_ids: list[list[int]] | None = None,
) -> dict[str, Tensor | None]:
    """(row, token) pairs that may not be sampled this step: the stop ids of rows short of
    min_tokens, and each row's banned ids (bad words).

    As in vLLM, the stop ids are `stop_token_ids` plus EOS unless `ignore_eos` (then EOS does
    not end the request, so there is nothing to hold off). Ids outside the logits' vocabulary
    can never be sampled and are dropped.
    """
    rows: list[int] = []
    cols: list[int] = []
    for row, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
        banned = banned_token_ids[row] if banned_token_ids else ()
        short = len(output) < p.min_tokens
        if not banned and not short:
            continue  # (most rows: no set to build)
        blocked = set(banned)
        if short:
            blocked |= set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        for token_id in sorted(t for t in blocked if t < vocab_size):
            rows.append(row)
            cols.append(token_id)
    if not rows:
        return {"blocked_rows": None, "blocked_token_ids": None}
    return {
        "blocked_rows": _row_tensor(rows, torch.int64, device),
        "blocked_token_ids": _row_tensor(cols, torch.int64, device),
    }


def _token_list_tensors(
    params: list[SamplingParams], token_masks: Tensor | None, eos_token_ids: list[int],
    vocab_size: int, device: torch.device, forced_token_ids: list[int | None] | None = None,
) -> dict[str, Tensor | None]:
    """allowed_token_ids, guided-decoding masks and forced tokens as one mask, logit_bias as
    (row, token, value) triples; the engine has checked that every id is in the vocabulary."""
    out: dict[str, Tensor | None] = dict.fromkeys(
        ("disallowed", "eos_token_ids", "bias_rows", "bias_token_ids", "bias_values")
    )
    allowed = [(row, p.allowed_token_ids) for row, p in enumerate(params) if p.allowed_token_ids]
    forced = [(row, t) for row, t in enumerate(forced_token_ids or []) if t is not None and t < vocab_size]
    if allowed or token_masks is not None or forced:
        disallowed = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
        for row, allowed_ids in allowed:
            disallowed[row] = True
            disallowed[row, allowed_ids] = False
        if token_masks is not None:  # (unpacked where the logits are: a 32nd of the bytes to move)
            disallowed |= refused_by_bitmask(token_masks.to(device), vocab_size)
        for row, token_id in forced:  # (over any mask: the grammar of a reply that thinks first waits for the end)
            disallowed[row] = True
            disallowed[row, token_id] = False
        out["disallowed"] = disallowed
        out["eos_token_ids"] = _row_tensor([t for t in eos_token_ids if t < vocab_size], torch.int64, device)
    biased = [(row, t, v) for row, p in enumerate(params) if p.logit_bias for t, v in p.logit_bias.items()]
    if biased:
        rows, biased_ids, values = zip(*biased, strict=True)
        out["bias_rows"] = _row_tensor(rows, torch.int64, device)
        out["bias_token_ids"] = _row_tensor(biased_ids, torch.int64, device)
        out["bias_values"] = _row_tensor(values, torch.float32, device)
    return out


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """A token bitmask [rows, words] int32 (bit t % 32 of word t // 32: token t) as [rows,
    vocab_size] bool; tokens past the mask's words are not allowed."""
    return ~refused_by_bitmask(bitmask, vocab_size)


_BITS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


def refused_by_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """The tokens a bitmask does not allow, [rows, vocab_size] bool, read byte by byte (an
    int32 word's bytes lie low first on every device genq runs on: byte k holds tokens 8k to
    8k + 7), four times faster than shifting words."""
    refused = (bitmask.contiguous().view(torch.uint8).unsqueeze(-1) & _BITS.to(bitmask.device)).eq(0).flatten(1)
    if refused.shape[1] < vocab_size:
        return torch.nn.functional.pad(refused, (0, vocab_size - refused.shape[1]), value=True)
    return refused[:, :vocab_size]
