"""Sampler tests: transformers' logits processors are the oracle for filters and penalties;
distributions are checked by sampling thousands of rows of a small vocabulary."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import cast

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from producer.sampling_params import SamplingParams
from worker.sample.sampler import (
    Sampler,
    SamplingBatch,
    apply_allowed_token_ids,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
    first_argmax,
)

CPU = torch.device("cpu")
EOS = 2

# Fixed logits over a vocabulary of 8: distinct, with mass spread enough that an off-by-one in
# a filter moves several percent of probability.
LOGITS_8 = torch.tensor([2.0, 1.6, 1.1, 0.7, 0.2, -0.4, -1.0, -2.5])

# The warpers ignore input_ids; they only need a [batch, 0] id tensor.
NO_INPUT_IDS = cast(torch.LongTensor, torch.zeros(1, 0, dtype=torch.long))


def build(
    params: list[SamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        [EOS],
        vocab_size,
        CPU,
    )


def hf_warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers in the same order as the sampler: temperature, top-k, top-p, min-p."""
    scores = logits.unsqueeze(0).clone()  # [1, vocab]
    no_ids = NO_INPUT_IDS
    scores = TemperatureLogitsWarper(params.temperature)(no_ids, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(no_ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(no_ids, scores)
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(params.min_p)(no_ids, scores)
    return scores.squeeze(0)


def total_variation(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - expected).abs().sum().item()


def tv_threshold(num_draws: int, vocab_size: int, false_alarm: float = 1e-6) -> float:
    """TV distance that an empirical distribution of num_draws exceeds with probability below
    false_alarm (Bretagnolle-Huber-Carol: P(TV >= t) <= (2^k - 2) exp(-2 n t^2))."""
    return math.sqrt(math.log((2**vocab_size - 2) / false_alarm) / (2 * num_draws))


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(seed=0)
    top1 = sampler(logits, build([SamplingParams(temperature=0.8, top_k=1)] * 32, 100))
    greedy = sampler(logits, build([SamplingParams(temperature=0.0)] * 32, 100))
    assert top1.token_ids == greedy.token_ids == logits.argmax(-1).tolist()


def test_greedy_rows_in_a_mixed_batch_take_the_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.3, top_p=0.5) for i in range(6)]
    out = Sampler(seed=3)(logits.to(torch.bfloat16), build(params, 50))
    argmax = logits.to(torch.bfloat16).float().argmax(-1).tolist()
    assert [out.token_ids[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


FILTER_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.75),
    SamplingParams(temperature=1.0, min_p=0.15),
    SamplingParams(temperature=1.4, top_k=6, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize(
    "params", FILTER_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"
)
def test_sampled_distribution_matches_transformers_warpers(params: SamplingParams) -> None:
    num_draws = 20_000
    expected = hf_warped(LOGITS_8, params).softmax(-1)  # [8]
    logits = LOGITS_8.expand(num_draws, -1)
    out = Sampler(seed=1234)(logits, build([params] * num_draws, 8))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).float()
    assert counts[expected == 0].sum() == 0, "a filtered token was sampled"
    assert total_variation(counts, expected) < tv_threshold(num_draws, 8)


def test_seeded_rows_sample_the_right_distribution() -> None:
    # Each row draws its noise from its own generator: the per-row path must be as correct as
    # the batched one.
    num_draws = 3000
    params = SamplingParams(temperature=0.9, top_p=0.85, seed=0)
    generators: list[torch.Generator | None] = [
        torch.Generator().manual_seed(seed) for seed in range(num_draws)
    ]
    batch = build([params] * num_draws, 8, generators=generators)
    out = Sampler(seed=0)(LOGITS_8.expand(num_draws, -1), batch)
    expected = hf_warped(LOGITS_8, params).softmax(-1)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).float()
    assert counts[expected == 0].sum() == 0
    assert total_variation(counts, expected) < tv_threshold(num_draws, 8)


def test_top_k_top_p_masks_equal_transformers() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 100, generator=gen) * 2  # [64, 100]
    top_k = torch.randint(1, 101, (64,), generator=gen)
    top_p = torch.rand(64, generator=gen).clamp(min=0.05)
    top_p[::4] = 1.0  # rows with top-p off must be untouched
    masked = apply_top_k_top_p(logits, top_k, top_p)
    no_ids = NO_INPUT_IDS
    for row in range(64):
        expected = TopKLogitsWarper(int(top_k[row]))(no_ids, logits[row : row + 1])
        if top_p[row] < 1.0:
            expected = TopPLogitsWarper(float(top_p[row]))(no_ids, expected)
        assert torch.equal(masked[row].isinf(), expected[0].isinf()), f"row {row}"
        kept = ~masked[row].isinf()
        assert torch.equal(masked[row][kept], logits[row][kept])


def random_history(gen: torch.Generator, vocab_size: int, length: int) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def test_repetition_penalty_equals_transformers() -> None:
    gen = torch.Generator().manual_seed(11)
    vocab_size, n = 40, 5
    logits = torch.randn(n, vocab_size, generator=gen) * 3  # positive and negative logits
    prompts = [random_history(gen, vocab_size, 10 + i) for i in range(n)]
    outputs = [random_history(gen, vocab_size, 3 * i) for i in range(n)]
    penalties = [1.0, 1.2, 0.8, 2.0, 1.05]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    ours = apply_penalties(logits, build(params, vocab_size, prompts, outputs))
    for row in range(n):
        input_ids = torch.tensor([prompts[row] + outputs[row]])
        expected = RepetitionPenaltyLogitsProcessor(penalties[row])(
            input_ids, logits[row : row + 1]
        )
        torch.testing.assert_close(ours[row], expected[0], rtol=0, atol=0)


def frequency_presence_reference(
    logits: list[float], output: list[int], frequency: float, presence: float
) -> list[float]:
    """The OpenAI definition: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence."""
    counts = Counter(output)
    return [
        value - counts[j] * frequency - (1.0 if counts[j] > 0 else 0.0) * presence
        for j, value in enumerate(logits)
    ]


def test_frequency_and_presence_penalties_follow_openai_over_output_only() -> None:
    gen = torch.Generator().manual_seed(12)
    vocab_size, n = 30, 4
    logits = torch.randn(n, vocab_size, generator=gen)
    prompts = [random_history(gen, vocab_size, 20) for _ in range(n)]  # must not count
    outputs = [random_history(gen, vocab_size, 8 * i) for i in range(n)]
    settings = [(0.0, 0.0), (0.5, 0.0), (0.0, -1.0), (1.5, 0.7)]
    params = [SamplingParams(frequency_penalty=f, presence_penalty=p) for f, p in settings]
    ours = apply_penalties(logits, build(params, vocab_size, prompts, outputs))
    for row, (frequency, presence) in enumerate(settings):
        expected = frequency_presence_reference(
            logits[row].tolist(), outputs[row], frequency, presence
        )
        torch.testing.assert_close(ours[row], torch.tensor(expected))


def test_repetition_then_frequency_presence_compose() -> None:
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(1, 20, generator=gen) * 2
    prompt, output = [1, 2, 3, 3], [3, 4, 4, 5]
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    ours = apply_penalties(logits, build([params], 20, [prompt], [output]))
    repeated = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + output]), logits)
    expected = frequency_presence_reference(repeated[0].tolist(), output, 0.3, 0.2)
    torch.testing.assert_close(ours[0], torch.tensor(expected))


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    vocab_size = 10
    logits = torch.zeros(5, vocab_size)
    logits[:, EOS] = 10.0  # EOS and the stop ids are by far the most likely tokens
    logits[:, 7] = 9.0
    logits[:, 8] = 8.0
    base = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7, 8])
    params = [
        base,  # 2 tokens out: blocked
        base,  # 3 tokens out: free
        replace(base, ignore_eos=True),  # 0 out, but EOS does not stop: not blocked
        replace(base, temperature=1.0),  # random row, 1 out: blocked
        SamplingParams(temperature=0.0),  # no min_tokens
    ]
    outputs = [[5, 5], [5, 5, 5], [], [5], []]
    batch = build(params, vocab_size, outputs=outputs)
    out = Sampler(seed=0)(logits, batch)
    assert out.token_ids[0] not in (EOS, 7, 8)
    assert out.token_ids[1] == EOS
    assert out.token_ids[2] == EOS
    assert out.token_ids[3] not in (EOS, 7, 8)
    assert out.token_ids[4] == EOS
    # The same mask as transformers' MinNewTokensLengthLogitsProcessor with every stop id.
    masked = apply_min_tokens(logits, batch)
    for row in (0, 1, 3):
        input_ids = torch.tensor([[9] * 4 + outputs[row]])
        processor = MinNewTokensLengthLogitsProcessor(4, 3, [EOS, 7, 8])
        torch.testing.assert_close(masked[row], processor(input_ids, logits[row : row + 1])[0])


def test_logit_bias_and_allowed_token_ids_equal_transformers() -> None:
    vocab_size = 12
    logits = torch.randn(4, vocab_size, generator=torch.Generator().manual_seed(7))
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 5.0, 9: -100.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[1, 4, 10]),
        SamplingParams(temperature=0.8, allowed_token_ids=[2, 5], logit_bias={5: 2.5, 6: 1.0}),
        SamplingParams(temperature=0.0),  # neither: untouched
    ]
    batch = build(params, vocab_size)
    got = apply_logit_bias(apply_allowed_token_ids(logits, batch), batch)
    for row, p in enumerate(params):
        expected = logits[row : row + 1].clone()
        no_ids = torch.zeros(1, 1, dtype=torch.long)
        if p.allowed_token_ids:
            allowed = PrefixConstrainedLogitsProcessor(lambda _b, _ids, a=p.allowed_token_ids: a, 1)
            expected = allowed(no_ids, expected)
        if p.logit_bias:
            bias = SequenceBiasLogitsProcessor([[[t], v] for t, v in p.logit_bias.items()])
            expected = bias(no_ids, expected)
        torch.testing.assert_close(got[row], expected[0])
    out = Sampler(seed=3)(logits, batch)
    assert [out.token_ids[0], out.token_ids[1]] == got[:2].argmax(-1).tolist()  # greedy rows
    assert out.token_ids[1] in (1, 4, 10) and out.token_ids[2] in (2, 5)


def test_a_row_with_nothing_left_to_sample_ends() -> None:
    # allowed_token_ids and a guided-decoding mask with nothing in common
    params = [SamplingParams(temperature=1.0, allowed_token_ids=[5]), SamplingParams(temperature=1.0)]
    masks = torch.tensor([[0b1011], [-1]], dtype=torch.int32)  # tokens 0, 1, 3; all of them
    batch = SamplingBatch.build(params, [[], []], [[], []], [None, None], [EOS], 8, CPU, token_masks=masks)
    logits = torch.zeros(2, 8)
    logits[0, 5] = 5.0
    out = Sampler(seed=1)(logits, batch)
    assert out.token_ids[0] == EOS
    # min_tokens would block the only token a row has left: it yields
    ends_only = SamplingParams(temperature=1.0, min_tokens=3, allowed_token_ids=[EOS])
    blocked = SamplingParams(temperature=1.0, min_tokens=3, allowed_token_ids=[EOS, 6])
    out = Sampler(seed=1)(torch.zeros(2, 8), build([ends_only, blocked], 8))
    assert out.token_ids == [EOS, 6]


def test_allowed_token_ids_hold_over_many_random_draws() -> None:
    logits = torch.zeros(2000, 8)
    params = SamplingParams(temperature=1.0, allowed_token_ids=[3, 6], logit_bias={6: 1.0})
    out = Sampler(seed=9)(logits, build([params] * 2000, 8))
    counts = Counter(out.token_ids)
    assert set(counts) == {3, 6}
    # P(6) = e / (1 + e) = 0.731; 2000 draws put it within 0.05 with overwhelming odds
    assert abs(counts[6] / 2000 - math.e / (1 + math.e)) < 0.05


def test_min_tokens_holds_over_many_random_draws() -> None:
    logits = torch.zeros(2000, 6)
    logits[:, EOS] = 2.0
    params = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[4])
    out = Sampler(seed=5)(logits, build([params] * 2000, 6))
    assert not set(out.token_ids) & {EOS, 4}


def step_logits(request: int, step: int, vocab_size: int) -> torch.Tensor:
    """A request's logits at a step, independent of the batch it is in."""
    return torch.randn(vocab_size, generator=torch.Generator().manual_seed(1000 * request + step))


def run_steps(
    requests: dict[int, SamplingParams], order: list[int], num_steps: int, sampler_seed: int
) -> dict[int, list[int]]:
    """Sample num_steps tokens for each request, batched in `order`; seeded requests keep one
    generator across steps as the engine does."""
    vocab_size = 64
    generators = {
        r: torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        for r, p in requests.items()
    }
    tokens: dict[int, list[int]] = {r: [] for r in order}
    sampler = Sampler(seed=sampler_seed)
    for step in range(num_steps):
        logits = torch.stack([step_logits(r, step, vocab_size) for r in order])  # [n, 64]
        batch = SamplingBatch.build(
            [requests[r] for r in order],
            [[r, r + 1] for r in order],
            [tokens[r] for r in order],
            [generators[r] for r in order],
            [EOS],
            vocab_size,
            CPU,
        )
        for r, token_id in zip(order, sampler(logits, batch).token_ids, strict=True):
            tokens[r].append(token_id)
    return tokens


def test_seeded_rows_reproduce_whatever_the_batch() -> None:
    requests = {
        0: SamplingParams(temperature=0.9, seed=42),
        1: SamplingParams(temperature=1.2, top_k=10, top_p=0.9, seed=7, repetition_penalty=1.3),
        2: SamplingParams(temperature=1.0),  # unseeded neighbour
        3: SamplingParams(temperature=0.0),  # greedy neighbour
        4: SamplingParams(temperature=0.7, min_p=0.1, seed=42, frequency_penalty=0.5),
        5: SamplingParams(temperature=1.1, top_p=0.6),  # unseeded, makes the batch sort
    }
    seeded = (0, 1, 4)
    reference = run_steps(requests, [0, 1, 2, 3, 4, 5], num_steps=12, sampler_seed=0)
    for order, sampler_seed in (([4, 5, 1, 0], 1), ([1], 2), ([0], 3), ([3, 2, 4, 1, 0], 4)):
        tokens = run_steps(requests, order, num_steps=12, sampler_seed=sampler_seed)
        for r in seeded:
            if r in order:
                assert tokens[r] == reference[r], f"request {r} in order {order}"


def expected_processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log_softmax of the logits after penalties (none here) and temperature."""
    temperature = params.temperature if params.temperature > 0 else 1.0
    return (logits / temperature).log_softmax(-1)


def test_logprobs_report_top_alternatives_and_rank() -> None:
    gen = torch.Generator().manual_seed(21)
    vocab_size = 50
    logits = torch.randn(4, vocab_size, generator=gen) * 2
    params = [
        SamplingParams(temperature=0.8, top_k=3, logprobs=5),  # filters do not change logprobs
        SamplingParams(temperature=1.0),  # did not ask
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.5, logprobs=0),  # the sampled token only
    ]
    out = Sampler(seed=3)(logits, build(params, vocab_size))
    assert out.logprobs is not None and out.logprobs[1] is None
    for row in (0, 2, 3):
        entry = out.logprobs[row]
        assert entry is not None
        expected = expected_processed_logprobs(logits[row], params[row])
        token_id = out.token_ids[row]
        assert entry.token_id == token_id
        assert entry.logprob == pytest.approx(expected[token_id].item(), abs=1e-5)
        assert entry.rank == int((expected > expected[token_id]).sum()) + 1
        k = params[row].logprobs
        top_values, top_ids = expected.topk(k) if k else (torch.empty(0), torch.empty(0))
        assert list(entry.top_logprobs) == top_ids.tolist()
        assert list(entry.top_logprobs.values()) == pytest.approx(top_values.tolist(), abs=1e-5)
    greedy_entry = out.logprobs[2]
    assert greedy_entry is not None and greedy_entry.rank == 1  # greedy takes the most likely


def test_logprobs_after_penalties() -> None:
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(22))
    params = SamplingParams(temperature=0.5, repetition_penalty=1.7, logprobs=20)
    out = Sampler()(logits, build([params], 20, prompts=[[0, 1, 2, 3]], outputs=[[4, 5]]))
    penalised = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[0, 1, 2, 3, 4, 5]]), logits)
    expected = (penalised[0] / 0.5).log_softmax(-1)
    entry = out.logprobs[0] if out.logprobs else None
    assert entry is not None and len(entry.top_logprobs) == 20
    for token_id, value in entry.top_logprobs.items():
        assert value == pytest.approx(expected[token_id].item(), abs=1e-5)


def test_no_logprobs_requested_gives_none() -> None:
    out = Sampler()(torch.randn(3, 10), build([SamplingParams()] * 3, 10))
    assert out.logprobs is None and len(out.token_ids) == 3


def test_shape_and_row_count_mismatches_raise() -> None:
    batch = build([SamplingParams()] * 2, 10)
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.randn(3, 10), batch)
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch.build([SamplingParams()] * 2, [[], []], [[], []], [None], [EOS], 10, CPU)


def test_kernel_path_draws_the_torch_paths_tokens() -> None:
    """The CUDA sampler's top-k / top-p kernel (here under TRITON_INTERPRET) takes the same
    noise as the torch path, so with distinct logits every row draws the same token; min_p
    rows keep the torch path."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(8, 300, generator=gen) * 3  # distinct values: no ties at a cut-off
    params = [SamplingParams(temperature=0.9, top_k=5), SamplingParams(temperature=1.2, top_p=0.6),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=40, top_p=0.8),
              SamplingParams(temperature=0.7), SamplingParams(temperature=1.5, top_p=0.95),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_k=250)]
    for batch_params in (params, [replace(p, min_p=0.05) for p in params[:4]]):
        rows = logits[: len(batch_params)]
        for seed in range(3):
            torch_path = Sampler(seed=seed)(rows, build(batch_params, 300)).token_ids
            kernel_path = Sampler(seed=seed, use_kernel=True)(rows, build(batch_params, 300)).token_ids
            assert kernel_path == torch_path, (seed, kernel_path, torch_path)


def test_first_argmax_is_argmax_ties_zeros_infinities_and_nans() -> None:
    """The CPU's blockwise argmax gives torch's argmax's index in every row: the first of equal
    maxima (+0 and -0 among them), 0 for a row of -inf, a row's first NaN; over a vocabulary
    not a multiple of its block, strided rows, and bfloat16."""
    gen = torch.Generator().manual_seed(0)
    vocab = 5 * 1024 + 37
    x = torch.randint(-3, 3, (12, vocab), generator=gen).float()  # ties everywhere
    x[1] = float("-inf")
    x[2] = torch.where(torch.rand(vocab, generator=gen) < 0.5, 0.0, -0.0)
    x[3, -1] = 9.0  # the max in the last, shorter block
    x[4, 5 * 1024 - 1] = 9.0  # the max at the end of a whole block
    x[4, -5] = 9.0
    with_nans = x.clone()
    with_nans[5, 4000], with_nans[5, 100] = float("nan"), float("nan")
    for y in (x, x.to(torch.bfloat16), x[:, 1:], x[:, :-40], with_nans):
        assert torch.equal(first_argmax(y), y.argmax(dim=-1))
    assert first_argmax(x)[1:5].tolist() == [0, 0, vocab - 1, 5 * 1024 - 1]
    assert first_argmax(with_nans)[5].item() == 100
