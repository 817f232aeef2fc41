"""Beam search (`use_beam_search` on completions and chat), run as vLLM runs it, outside the
engine: each step asks the workers for the likeliest next tokens of every live beam (one
greedy one-token job per beam, with its top 2 x width logprobs; the prefix cache keeps each
beam's prompt computed from the step before), and producer.beam_search keeps the best.

Prompts are tokenized here with the tokenizer the workers published (api.tokenizers), so each
step can send token ids; the chosen sequences are decoded with it too.
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any

import anyio

from api import generate
from api.api_keys import job_priority
from api.deps import TENANT, AppState
from api.errors import APIError, invalid_param
from api.generate import GenerationRequest, cache_fields
from api.logprobs import top_token_pairs
from api.render import Choice, RelayedRequest, Renderer
from api.request_bodies import ChatCompletionRequest, PromptInput, service_tier_of
from api.response_bodies import Usage
from api.tokenizers import base_model, eos_token_ids, job_prompt_ids
from producer.beam_search import Beam, best, step
from producer.jobs import build_job
from producer.protocol import ERROR_INVALID_REQUEST
from producer.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step asks for 2 x width alternatives per beam


def check(body: GenerationRequest) -> None:
    """400 for what beam search does not combine with."""
    if body.stream:
        raise invalid_param("use_beam_search", "beam search does not stream")
    if not 1 <= body.n <= MAX_BEAM_WIDTH:
        raise invalid_param("n", f"with beam search n is the beam width: 1 to {MAX_BEAM_WIDTH}, got {body.n}")
    if body.guided_source is not None:
        raise invalid_param(body.guided_source, "guided decoding does not combine with beam search")


async def respond(
    state: AppState, body: GenerationRequest, prompts: list[PromptInput], renderer: Renderer
) -> Any:
    """The response to a beam-search request: for each prompt, its `n` best beams."""
    check(body)
    model = await generate.resolve_model(state, body.model)
    await generate.check_backpressure(state)
    job_model = await generate.job_model(state, body.model, model)
    base_name = (await base_model(state.cluster, model))[0]
    tokenizer = await state.tokenizers.get(state.client, base_name)
    eos = set() if body.ignore_eos else await eos_token_ids(state.client, base_name, tokenizer)
    max_tokens = body.sampling_params().max_tokens or 16
    base = uuid.uuid4().hex
    priority = job_priority(body.requested_priority())  # every step's jobs run at it
    choices: list[Choice] = []
    prompt_tokens = 0
    for i, prompt in enumerate(prompts):
        try:
            prompt_ids = job_prompt_ids(tokenizer, build_job(prompt, model=job_model))
        except ValueError as exc:
            raise invalid_param("messages" if isinstance(body, ChatCompletionRequest) else "prompt", str(exc)) from exc
        prompt_tokens += len(prompt_ids)
        beams = await search(state, prompt_ids, body, eos, max_tokens, job_model, f"{base}-{i}", priority)
        for j, beam in enumerate(beams):
            text = tokenizer.decode(beam.tokens, skip_special_tokens=body.skip_special_tokens)
            choices.append(Choice(i * body.n + j, text=text, token_ids=beam.tokens, finish_reason=beam.finish_reason))
    completion_tokens = sum(len(c.token_ids) for c in choices)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                  total_tokens=prompt_tokens + completion_tokens)
    req = RelayedRequest(id=renderer.id_prefix + base, job_ids=[], n=body.n, model=model, created=int(time.time()),
                         service_tier=service_tier_of(priority))
    return renderer.response(req, choices, usage)


async def search(
    state: AppState, prompt_ids: list[int], body: GenerationRequest, eos: set[int], max_tokens: int,
    model: str | None, base: str, priority: int,
) -> list[Beam]:
    """The `body.n` best beams after `max_tokens` steps (or once every beam has ended), each
    step's jobs at `priority`."""
    width = body.n
    live, done = [Beam()], []
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    beams = [f"{base}-beam-{k}" for k in range(width)]  # a managed key's jobs in flight: a beam's each, throughout
    await generate.reserve_in_flight(state, beams)
    try:
        for n in range(max_tokens):
            ids = [f"{base}-{n}-{k}" for k in range(len(live))]
            for beam, job_id in zip(live, ids, strict=True):
                await state.client.submit(cache_fields({"prompt_token_ids": prompt_ids + beam.tokens}, body), params,
                                          job_id=job_id, model=model, priority=priority,
                                          tenant=TENANT.get())
            tops = await _next_tokens(state, ids)
            live, finished = step(live, [tops[job_id] for job_id in ids], width, eos)
            done += finished
            if not live:
                break
    finally:
        with anyio.CancelScope(shield=True):  # (a client gone cancels this task)
            await generate.release_in_flight(state, beams)
    return best(done, live, width, body.length_penalty)


async def _next_tokens(state: AppState, job_ids: list[str]) -> dict[str, list[tuple[int, float]]]:
    """Each one-token job's top alternatives (token id, logprob), best first; the jobs are
    cancelled if this stops early."""
    tops: dict[str, list[tuple[int, float]]] = {}
    ended = False
    try:
        follow = state.relay.follow(job_ids, timeout_s=state.settings.request_timeout_s)
        async with aclosing(follow) as events:
            async for job_id, event in events:
                if event.error is not None:
                    status, kind, code = generate.error_kind(event.error_type == ERROR_INVALID_REQUEST)
                    raise APIError(status, f"job {job_id} failed: {event.error}", type=kind, code=code)
                for entry in event.logprobs or []:
                    tops[job_id] = top_token_pairs(entry.get("top_logprobs") if isinstance(entry, dict) else entry)
        ended = True
    except TimeoutError as exc:
        raise APIError(504, str(exc), type="timeout_error", code="timeout") from exc
    finally:
        if not ended:
            await generate.cancel_jobs(state, job_ids)
    return tops
