"""Relaying one OpenAI request: check it, submit its jobs, follow their events, then either
collect them into one response or stream them as SSE chunks.

Jobs that the request stops following before they end (the client went away, the request
timed out, one of its jobs failed) are cancelled, so no worker keeps generating for nobody.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import anyio
import redis

from api import request_log
from api.api_keys import PLAN, in_flight_limit, job_priority
from api.deps import TENANT, TRACEPARENT, AppState
from api.errors import APIError, error_body, param_from_value_error
from api.logprobs import TokenLogprob, prompt_logprobs
from api.parsers.harmony import FINAL_CHANNEL
from api.parsers.reasoning import TAGS as THINK_TAGS
from api.parsers.strict_calls import strict_calls
from api.render import Choice, RelayedRequest, Renderer, usage_chunk
from api.request_bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptInput,
    service_tier_of,
)
from api.response_bodies import Usage
from api.sse import DONE, format_sse
from api.tokenizers import base_model
from producer.jobs import JobLost, build_job
from producer.pooling_params import PoolingParams
from producer.protocol import ERROR_INVALID_REQUEST, Event, ProtocolError
from producer.redis_conn import mget, pipeline
from producer.sampling_params import SamplingParams
from producer.trace_log import TraceLog

GenerationRequest = CompletionRequest | ChatCompletionRequest


async def start(
    state: AppState,
    body: GenerationRequest,
    prompts: list[PromptInput],
    renderer: Renderer,
    job_id: str | None = None,
    deadline_s: float | None = None,
) -> RelayedRequest:
    """Validate, apply backpressure, submit one job per prompt; raises APIError."""
    model = await resolve_model(state, body.model)
    await check_backpressure(state)
    defaults = await state.cluster.sampling_defaults(model)
    planned = plan(state, body, prompts, renderer, job_id or uuid.uuid4().hex, model, deadline_s, defaults=defaults)
    planned = replace(planned, model=await job_model(state, body.model, model))
    await check_fits(state, body, planned, model)
    return await submit(state, planned)


async def check_fits(state: AppState, body: GenerationRequest, planned: Plan, model: str) -> None:
    """The API's early share of the workers' rule (worker.core.engine.check_fits): a 400 naming both
    numbers where a prompt and max_tokens cannot fit the smallest max_model_len of the workers
    serving `model`, before any job is queued. A prompt of token ids counts as given; any other
    counts as one token (its true count is the worker's to check)."""
    max_tokens = planned.params.max_tokens
    if max_tokens is None or planned.pooling_params is not None or planned.params.clamp_max_tokens:
        return
    max_model_len = (await base_model(state.cluster, model, max_age_s=1.0))[1]
    if max_model_len is None:
        return
    keep = planned.params.truncate_prompt_tokens  # (the worker cuts the prompt first: -1 to fit max_tokens)
    for prompt in planned.prompts:
        count = _given_prompt_len(prompt)
        if count is not None and keep is not None:
            count = min(count, keep) if keep > 0 else None
        known = "" if count is not None else "at least "
        count = count or 1
        if count + max_tokens > max_model_len:
            param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
            raise APIError(
                400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{known}{count + max_tokens} tokens ({known}{count} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the length of the prompt or {param}.", param=param, code="invalid_value")


def _given_prompt_len(prompt: PromptInput) -> int | None:
    """How many tokens a prompt given as token ids has; None for text or messages."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
    if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        return len(ids)
    return None


async def job_model(state: AppState, requested: str | None, resolved: str) -> str | None:
    """The model a request's jobs name: the request's; when it names none and workers are
    live, the one its reply names, so the jobs reach that model's queue wherever it is."""
    if requested is None and await state.cluster.served_models(max_age_s=1.0):
        return resolved
    return requested


@dataclass(frozen=True)
class Plan:
    """The jobs of one request, checked and ready to submit, and how to relay them."""

    req: RelayedRequest
    prompts: list[PromptInput]
    params: SamplingParams
    priority: int
    model: str | None  # as the request names it (None: whatever the workers serve)
    deadline_s: float | None
    pooling_params: PoolingParams | None = None  # set: embedding jobs (api.embeddings)
    tenant: str | None = None  # who the jobs are metered to; None: the caller's key (deps.TENANT)


# where a guided reply's grammar starts, for parsers whose replies think first: after the
# thinking's end tag; after gpt-oss's final channel opens (its tags are special tokens, which
# the worker spells for markers)
GRAMMAR_AFTER = {**{name: tags.end for name, tags in THINK_TAGS.items() if tags.opened}, "gpt_oss": FINAL_CHANNEL}
# tool-call formats that open with a special token (Llama 4's pythonic calls: <|python_start|>)
SPECIAL_TOKEN_FORMATS = ("llama3_json", "mistral", "granite", "pythonic", "deepseek_v3", "deepseek_v31", "kimi_k2",
                         "seed_oss", "minimax_m2")


def plan(
    state: AppState,
    body: GenerationRequest,
    prompts: list[PromptInput],
    renderer: Renderer,
    base: str,
    model: str,
    deadline_s: float | None = None,
    priority_offset: int = 0,
    defaults: dict[str, Any] | None = None,
) -> Plan:
    """Check a request and build its jobs (one per prompt, ids from `base`) without submitting
    any; raises APIError naming what is wrong. `defaults`: the model's sampling values for the
    fields the request leaves unset (Cluster.sampling_defaults)."""
    chat = body if isinstance(body, ChatCompletionRequest) else None
    reasoning = _reasoning_parser(state, chat)
    params = sampling_params(body, defaults)
    prompts = [cache_fields(p, body) for p in prompts]
    read_tool_calls = chat.tool_calls_form() if chat else None
    if read_tool_calls == "auto":  # check_tool_parser has refused "auto" where the parser is "none"
        parser = state.settings.tool_call_parser
        read_tool_calls = parser if parser != "none" else None
    if chat is not None and params.guided_decoding is None:
        params = _strict_calls(params, chat, read_tool_calls)
    if reasoning in GRAMMAR_AFTER and params.guided_decoding is not None:
        # the reply thinks first: the grammar holds for the answer, after the thinking's end
        params = replace(params, guided_decoding={**params.guided_decoding, "after": GRAMMAR_AFTER[reasoning]})
    special_tags = reasoning == "gpt_oss" or (reasoning in THINK_TAGS and THINK_TAGS[reasoning].special)
    if special_tags or read_tool_calls in SPECIAL_TOKEN_FORMATS:
        # harmony's tags, Magistral's [THINK], Llama 3's and Mistral's call tokens are special
        # tokens: the readers need them in the text
        params = replace(params, skip_special_tokens=False)
    ids = job_ids(base, len(prompts))
    check_jobs(body, prompts, ids, params, deadline_s)
    echo = isinstance(body, CompletionRequest) and body.echo
    forced = chat.forced_tool() if chat else None
    req = RelayedRequest(
        id=renderer.id_prefix + base, job_ids=ids, n=params.n, model=model,
        created=int(time.time()), include_usage=body.include_usage, continuous_usage=body.continuous_usage,
        num_logprobs=params.logprobs,
        echo=tuple(p if isinstance(p, str) else None for p in prompts) if echo else (),
        prompt_logprobs=body.prompt_logprobs is not None,
        tool_call=forced.name if forced else None,
        read_tool_calls=read_tool_calls,
        string_parameters=chat.string_parameters() if chat else (),
        parallel_tool_calls=chat is None or chat.parallel_tool_calls,
        reasoning_parser=reasoning,
        include_reasoning=chat is None or chat.include_reasoning,
        chat_echo=chat.echoed() if chat and not forced else None,  # (a forced call's reply is no text)
        return_token_ids=bool(body.return_token_ids),
        tokens_as_ids=bool(body.return_tokens_as_token_ids),
        guide_param=None if params.guided_decoding is None else body.guided_source or "tools",  # (strict tools')
    )
    return Plan(req, prompts, params, body.requested_priority() + priority_offset, body.model, deadline_s)


def _strict_calls(params: SamplingParams, chat: ChatCompletionRequest, parser: str | None) -> SamplingParams:
    """An auto reply's calls held to their strict tools (api.parsers.strict_calls); a tool schema
    of the wrong shape is a 400 naming the tools (one the worker cannot compile fails its job,
    naming them too: RelayedRequest.guide_param)."""
    tag = strict_calls(parser, [t.function for t in chat.tools or []], chat.parallel_tool_calls)
    if tag is None:
        return params
    try:
        return replace(params, guided_decoding={"structural_tag": tag})
    except ValueError as exc:
        raise APIError(400, str(exc).replace("guided_decoding structural_tag", "a strict tool's call:", 1),
                       param="tools", code="invalid_value") from exc


def cache_fields(prompt: PromptInput, body: GenerationRequest) -> PromptInput:
    """A job's prompt with the request's vLLM `cache_salt` (the prefix cache shares its blocks
    only with prompts of the same salt), OpenAI `prompt_cache_key` and the request span's
    `traceparent` (when traced) beside it."""
    beside = {k: v for k, v in (("cache_salt", body.cache_salt), ("prompt_cache_key", body.prompt_cache_key),
                                ("traceparent", TRACEPARENT.get())) if v}
    if not beside:
        return prompt
    as_mapping = prompt if isinstance(prompt, dict) else {"prompt": prompt} if isinstance(prompt, str) else {"messages": prompt}
    return {**as_mapping, **beside}


def job_ids(base: str, count: int) -> list[str]:
    """The ids of a request's jobs, one per prompt: `base`, or `base-0`, `base-1`, ..."""
    return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]


async def submit(state: AppState, planned: Plan) -> RelayedRequest:
    """Enqueue a plan's jobs (each once: a known id is not enqueued again)."""
    enqueued = False
    priority = job_priority(planned.priority)
    await reserve_in_flight(state, planned.req.job_ids)
    try:
        for prompt, job_id in zip(planned.prompts, planned.req.job_ids, strict=True):
            handle = await state.client.submit(
                prompt, planned.params, priority=priority, job_id=job_id,
                deadline_s=planned.deadline_s, model=planned.model, pooling_params=planned.pooling_params,
                tenant=planned.tenant or TENANT.get(), return_prompt_token_ids=planned.req.return_token_ids,
            )
            enqueued = handle.enqueued or enqueued
    except BaseException:
        await release_in_flight(state, planned.req.job_ids)  # (what was enqueued is relayed by nobody)
        raise
    return replace(planned.req, enqueued=enqueued, service_tier=service_tier_of(priority))


def _reasoning_parser(state: AppState, chat: ChatCompletionRequest | None) -> str | None:
    """The deployment's, for chat replies that may think: a guided reply is held to its
    grammar from its first token, unless the reply thinks first (deepseek_r1, gpt_oss), where
    the grammar starts after the thinking. Under deepseek_r1 a request that turns thinking
    off for the template (Qwen3's and Nemotron 3's `enable_thinking`, DeepSeek-V3.1's
    `thinking`) is read as qwen3: its reply starts answering. Under deepseek_v3 the template
    thinks only when the request turns it on: such a reply is read as deepseek_r1's, any other
    has no reasoning."""
    parser: str | None = state.settings.reasoning_parser
    if chat is None or parser == "none":
        return None
    if parser == "deepseek_v3":
        parser = "deepseek_r1" if chat.thinking_on() else None
    elif parser == "deepseek_r1" and chat.thinking_off():
        parser = "qwen3"  # the template closes the thinking in the prompt: the reply answers
    if parser is None:
        return None
    if chat.guided_source is not None and parser not in GRAMMAR_AFTER:
        return None
    return parser


def check_jobs(
    body: GenerationRequest,
    prompts: list[PromptInput],
    job_ids: list[str],
    params: SamplingParams,
    deadline_s: float | None,
) -> None:
    """Build every job before enqueueing any, so one bad prompt of a list enqueues nothing."""
    try:
        for prompt, one_id in zip(prompts, job_ids, strict=True):
            build_job(prompt, params, body.requested_priority(), one_id, deadline_s, body.model)
    except ValueError as exc:
        raise _bad_value(exc, body) from exc


def sampling_params(body: GenerationRequest, defaults: dict[str, Any] | None = None) -> SamplingParams:
    try:
        return body.sampling_params(defaults)
    except ValueError as exc:
        raise _bad_value(exc, body) from exc


def _bad_value(exc: ValueError, body: GenerationRequest) -> APIError:
    aliases = {"prompt_token_ids": "prompt", "job": "job_id"}
    try:
        aliases["guided_decoding"] = body.guided_source or "guided_decoding"
    except ValueError:
        pass  # two guided fields: the error being reported is that one
    if isinstance(body, ChatCompletionRequest):
        aliases["logprobs"] = "top_logprobs"
        if body.max_completion_tokens is not None:
            aliases["max_tokens"] = "max_completion_tokens"
    param = param_from_value_error(exc, aliases)
    return APIError(400, str(exc), param=param, code="invalid_value")


async def resolve_model(state: AppState, requested: str | None) -> str:
    """The model a response names. 404 for one no live worker serves (when any is live), or
    one the caller's managed key may not use."""
    plan = PLAN.get()
    served = [m for m in await state.cluster.served_models(max_age_s=1.0) if plan is None or plan.allows(m)]
    if requested is None:
        if plan is not None and plan.models is not None and not served:
            raise APIError(404, "This API key may use none of the models served now.", param="model",
                           code="model_not_found")
        return served[0] if served else state.settings.served_model_name
    if (served or plan is not None) and requested not in served:
        raise APIError(
            404, f"The model `{requested}` does not exist or this API key may not use it (served: "
            f"{', '.join(served) or 'none to this key'}).", param="model", code="model_not_found",
        )
    return await state.cluster.model_named(requested, max_age_s=1.0)  # an alias answers as its model, as vLLM's


async def check_backpressure(state: AppState) -> None:
    """429 with Retry-After while the caller's key is past its requests per minute, or the
    queue is at its limit. The queue's is a soft limit: concurrent submissions that all pass
    the check can overshoot it by their number."""
    await check_rate_limit(state)
    limit = state.settings.max_queued_jobs
    if limit is None:
        return
    depth = await state.cluster.queue_depth(cap=limit + 1)
    if depth.total >= limit:
        raise APIError(
            429, f"The queue is full ({depth.total} jobs queued, limit {limit}); retry later.",
            type="rate_limit_error", code="queue_full",
            headers={"Retry-After": str(state.settings.retry_after_s)},
        )


async def check_rate_limit(state: AppState) -> None:
    """Count this request against its key's minute (a fixed window in Redis, shared by every
    API process); 429 past GENQ_RATE_LIMIT_RPM (or the managed key's own rpm), or once the
    key's jobs used GENQ_RATE_LIMIT_TPM (its tpm) tokens this minute (the workers count them as they read prompts and write tokens, so a
    long generation counts while it runs)."""
    plan, tenant = PLAN.get(), TENANT.get()
    rpm = plan.rpm if plan and plan.rpm is not None else state.settings.rate_limit_rpm
    tpm = plan.tpm if plan and plan.tpm is not None else state.settings.rate_limit_tpm
    now = time.time()
    await _check_in_flight(state, now)
    if tenant is None or (rpm is None and tpm is None):
        return
    minute = int(now // 60)
    if tpm is not None:
        counters = [k.tokens(tenant, minute) for k in state.client.keys.every_shard]  # (one per shard)
        used = sum(int(n or 0) for n in await mget(state.client.redis, counters))
        if used >= tpm:
            _rate_limited(f"{tpm} tokens per minute", now)
    if rpm is not None:
        key = state.client.keys.rate(tenant, minute)
        pipe = pipeline(state.client.redis)
        pipe.incr(key)
        pipe.expire(key, 120)
        count, _ = await pipe.execute()
        if count > rpm:
            _rate_limited(f"{rpm} requests per minute", now)


# A managed key's jobs in flight: drop those past their time; then, unless as many as the
# limit are left, count the request's jobs in until a time. KEYS[1]: the key's in-flight set.
# ARGV[1]: now, [2]: the limit, [3]: until, [4]: the set's TTL, [5...]: job ids (none: only
# check). Returns the jobs in flight found, and whether the request's were counted in.
_IN_FLIGHT_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local count = redis.call('ZCARD', KEYS[1])
if count >= tonumber(ARGV[2]) or #ARGV < 5 then return {count, 0} end
for i = 5, #ARGV do redis.call('ZADD', KEYS[1], ARGV[3], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {count, 1}
"""


async def _check_in_flight(state: AppState, now: float) -> None:
    """429 while the caller's managed key has as many jobs queued or running as it may
    (`genq keys --max-in-flight`), before the request is planned (and counted against its
    rpm): reserve_in_flight holds the limit."""
    await reserve_in_flight(state, [], now)


async def reserve_in_flight(state: AppState, job_ids: list[str], now: float | None = None) -> None:
    """Count a managed key's request's jobs in flight, at once with the check that fewer than
    its limit are (one Redis script: requests made at once cannot all pass); 429 where as
    many are. A job counts from its submit until its relay ends, or for
    GENQ_REQUEST_TIMEOUT_S at most (an API process that stopped relaying it frees it then)."""
    limited = in_flight_limit()
    if limited is None:
        return
    name, limit = limited
    now = time.time() if now is None else now
    timeout = state.settings.request_timeout_s
    count, counted = await state.client.redis.eval(  # type: ignore[misc]
        _IN_FLIGHT_LUA, 1, state.client.keys.in_flight(name), now, limit, now + timeout, int(timeout) + 60, *job_ids)
    if count >= limit and not counted:
        raise APIError(
            429, f"Rate limit reached: {count} jobs in flight for this API key, which may have {limit} at once; "
            "retry when one ends.", type="rate_limit_error", code="rate_limit_exceeded",
            headers={"Retry-After": str(state.settings.retry_after_s)},
        )


async def release_in_flight(state: AppState, job_ids: list[str]) -> None:
    """A managed key's jobs no longer in flight: relayed (or never enqueued)."""
    limited = in_flight_limit()
    if limited is None or not job_ids:
        return
    await state.client.redis.zrem(state.client.keys.in_flight(limited[0]), *job_ids)


def _rate_limited(what: str, now: float) -> NoReturn:
    retry = max(1, math.ceil(60 - now % 60))
    raise APIError(
        429, f"Rate limit reached: {what} for this API key; retry in {retry} s.",
        type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(retry)},
    )


async def cancel_jobs(state: AppState, job_ids: list[str]) -> None:
    """Cancel, shielded: this runs while the request's own task is being cancelled."""
    with anyio.CancelScope(shield=True):
        for job_id in job_ids:
            await state.client.cancel(job_id)


async def relay_events(
    state: AppState, req: RelayedRequest, keep_jobs: bool = False
) -> AsyncGenerator[tuple[str, Event], None]:
    """The request's events with latency metrics; cancels its jobs unless all ended (or
    `keep_jobs`: a background response's jobs outlive whoever waits for them)."""
    timer = state.metrics.timer()
    logged = request_log.Relayed(req.id, req.job_ids, req.model)
    ended, outcome = False, "cancelled"
    try:
        follow = state.relay.follow(req.job_ids, timeout_s=state.settings.request_timeout_s)
        async with aclosing(follow) as events:
            async for job_id, event in events:
                timer.on_event(job_id, event)
                logged.on_event(job_id, event)
                yield job_id, event
        ended, outcome = True, "completed"
        timer.on_end()
    except TimeoutError:
        outcome = "timeout"
        raise
    except Exception:
        outcome = "failed"
        raise
    finally:
        logged.on_close(outcome)
        if not ended and not keep_jobs:
            await cancel_jobs(state, req.job_ids)
        with anyio.CancelScope(shield=True):  # (a client gone cancels this task)
            await release_in_flight(state, req.job_ids)


class Collector:
    """The choices and usage of one request, as its events arrive."""

    def __init__(self, req: RelayedRequest) -> None:
        self.req = req
        self.choices = [Choice(i) for i in range(req.num_choices)]
        self.prompt_tokens: dict[str, int] = {}  # per job, from the worker's usage
        self.cached_tokens: dict[str, int] = {}  # per job, when the worker reports it
        self.error: str | None = None
        self.invalid_request = False  # the failed job was at fault, not the worker
        self.echoes: dict[str, tuple[str, list[TokenLogprob]]] = {}  # per job, once known

    def add(self, job_id: str, event: Event) -> Choice:
        choice = self.choices[self.req.choice_index(job_id, event)]
        if self.req.echo and choice.num_events == 0:
            choice.echo(*self._echo(job_id, event))
        if event.prompt_logprobs is not None:  # the job's: every choice of it shows them
            for sibling in self._siblings(job_id):
                sibling.prompt_logprobs = event.prompt_logprobs
        if event.usage is not None:
            self.prompt_tokens[job_id] = int(event.usage.get("prompt_tokens", 0))
            for sibling in self._siblings(job_id):
                sibling.prompt_tokens = self.prompt_tokens[job_id]
            if "cached_tokens" in event.usage:
                self.cached_tokens[job_id] = int(event.usage["cached_tokens"])
        choice.add(event)
        if event.error is not None:
            self.error = f"job {job_id} failed: {event.error}"
            self.invalid_request = event.error_type == ERROR_INVALID_REQUEST
        return choice

    def _siblings(self, job_id: str) -> list[Choice]:
        """The choices of one job: its n completions."""
        first = self.req.job_ids.index(job_id) * self.req.n
        return self.choices[first : first + self.req.n]

    def error_kind(self) -> tuple[int, str, str]:
        """(status, type, code) of the failure: the request's fault (400: sending it again
        cannot help) or the server's (500)."""
        return error_kind(self.invalid_request)

    def error_param(self) -> str | None:
        """The request field the failure names: its guide's, where the worker refused that."""
        if self.invalid_request and self.error is not None and "guided_decoding" in self.error:
            return self.req.guide_param
        return None

    def _echo(self, job_id: str, event: Event) -> tuple[str, list[TokenLogprob]]:
        """The prompt's text and logprobs. The worker sends its part (the decoded prompt, the
        logprobs) on completion 0's first event, which comes before the other completions'."""
        if job_id not in self.echoes or event.prompt_logprobs is not None:
            text = self.req.echo[self.req.job_ids.index(job_id)]
            logprobs = prompt_logprobs(event.prompt_logprobs) if self.req.logprobs else []
            self.echoes[job_id] = ((event.prompt or "") if text is None else text, logprobs)
        return self.echoes[job_id]

    def usage(self) -> Usage:
        """Prompt tokens as the worker counted them (once per prompt, as OpenAI); completion
        tokens as relayed."""
        prompt = sum(self.prompt_tokens.values())
        completion = sum(len(c.token_ids) for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.cached_tokens:
            usage["cached_tokens"] = sum(self.cached_tokens.values())
        return Usage.from_protocol(usage)


def error_kind(invalid_request: bool) -> tuple[int, str, str]:
    """(status, type, code) of a failed job: its own fault (400) or the server's (500)."""
    if invalid_request:
        return 400, "invalid_request_error", "invalid_request"
    return 500, "server_error", "job_failed"


JOB_LOST = "job_lost"  # the code of a job whose record vanished from Redis while it was followed


async def collect(state: AppState, req: RelayedRequest, renderer: Renderer, keep_jobs: bool = False) -> Any:
    """The whole response once every job ended; APIError for a failed job (500) or a timeout
    (504)."""
    collector = Collector(req)
    try:
        async with aclosing(relay_events(state, req, keep_jobs)) as events:
            async for job_id, event in events:
                collector.add(job_id, event)
                if collector.error is not None:
                    status, kind, code = collector.error_kind()
                    raise APIError(status, collector.error, type=kind, param=collector.error_param(), code=code)
    except TimeoutError as exc:
        raise APIError(504, str(exc), type="timeout_error", code="timeout") from exc
    except JobLost as exc:  # a Redis without persistence restarted under it: nothing will end it
        raise APIError(503, str(exc), type="server_error", code=JOB_LOST) from exc
    return renderer.response(req, collector.choices, collector.usage())


@dataclass(frozen=True)
class StreamError:
    """What ended a stream early: the failed job's error, a timeout, a lost relay."""

    message: str
    type: str
    code: str


async def relayed_chunks(
    state: AppState, req: RelayedRequest, renderer: Renderer, collector: Collector, keep_jobs: bool = False
) -> AsyncGenerator[dict[str, Any] | StreamError | None, None]:
    """Each event's chunk (None when it brings nothing to send), the collector kept up to
    date; a StreamError last if the stream ended early. `keep_jobs`: see relay_events."""
    try:
        async with aclosing(relay_events(state, req, keep_jobs)) as events:
            async for job_id, event in events:
                choice = collector.add(job_id, event)
                if collector.error is not None:
                    _, kind, code = collector.error_kind()
                    yield StreamError(collector.error, kind, code)
                    return
                yield renderer.chunk(req, choice, event)
                if state.trace is not None:  # (resumed: the chunk before was written to the client)
                    _trace_relay(state.trace, job_id, event)
    except TimeoutError as exc:
        yield StreamError(str(exc), "timeout_error", "timeout")
    except JobLost as exc:
        collector.error = str(exc)
        yield StreamError(str(exc), "server_error", JOB_LOST)
    except (redis.RedisError, ProtocolError) as exc:  # the response has started: say it inline
        collector.error = str(exc)
        yield StreamError(f"relay failed: {exc}", "server_error", "relay_error")


def _trace_relay(trace: TraceLog, job_id: str, event: Event) -> None:
    """The relay line of an event just written to the client: the delay from its step's end
    (the time a tracing worker sets on it) to now."""
    now = time.time()
    trace.write("relay", job=job_id, index=event.index, seq=event.seq, tokens=len(event.token_ids),
                text=bool(event.text), step_time=event.time, written=now,
                ms=None if event.time is None else round((now - event.time) * 1000, 3))


async def stream(
    state: AppState, req: RelayedRequest, renderer: Renderer
) -> AsyncGenerator[str, None]:
    """SSE lines in OpenAI's format; an error arrives as `data: {"error": ...}` before [DONE]."""
    collector = Collector(req)
    for first in renderer.preamble(req):
        yield format_sse(first)
    async with aclosing(relayed_chunks(state, req, renderer, collector)) as chunks:
        async for chunk in chunks:
            if isinstance(chunk, StreamError):
                yield format_sse(error_body(chunk.message, chunk.type, code=chunk.code))
            elif chunk is not None:
                yield format_sse(chunk)
    if req.include_usage and collector.error is None:
        yield format_sse(usage_chunk(req, renderer.object_name, collector.usage()))
    yield DONE
