"""Job endpoints for asynchronous use: submit, poll, follow (SSE, resumable), cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Header, Response

from api import generate, jobs
from api.chat import chat_prompt
from api.completions import reject_unsupported
from api.deps import ClientDep, RelayDep, StateDep
from api.errors import invalid_param
from api.render import ChatRenderer, CompletionRenderer, Renderer
from api.request_bodies import ChatJobRequest, JobRequest, PromptInput
from api.response_bodies import JobCreated, JobView
from api.sse import EventStreamResponse

router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.post("", status_code=202, response_model=JobCreated)
async def create_job(
    body: Annotated[JobRequest, Body()], state: StateDep, response: Response
) -> JobCreated:
    """A completions or chat body (`kind`, else chat when it has `messages`); 202 with the id."""
    if body.stream:
        raise invalid_param("stream", "jobs do not stream: follow GET /v1/jobs/{id}/events")
    prompts: list[PromptInput]
    renderer: Renderer
    if isinstance(body, ChatJobRequest):
        prompts, renderer = [chat_prompt(body)], ChatRenderer()
    else:
        reject_unsupported(body, state.settings.max_prompt_embeds_bytes)
        if body.echo:
            raise invalid_param("echo", "a job's outputs hold only what was generated; echo is for /v1/completions")
        prompts, renderer = body.prompts(), CompletionRenderer()
        if len(prompts) != 1:
            raise invalid_param("prompt", "a job has one prompt: submit one job per prompt")
    req = await generate.start(
        state, body, prompts, renderer, job_id=body.job_id, deadline_s=body.deadline_s
    )
    job_id = req.job_ids[0]
    status = await state.client.status(job_id)
    response.headers["Location"] = f"/v1/jobs/{job_id}"
    return JobCreated(id=job_id, status=status.value, created=req.created, enqueued=req.enqueued)


@router.get("/{job_id}", response_model=JobView)
async def get_job(job_id: str, client: ClientDep, relay: RelayDep) -> JobView:
    """Status; outputs and usage once it has ended. 404 for an unknown id."""
    return await jobs.job_view(client, relay, job_id)


@router.get("/{job_id}/events")
async def job_events(
    job_id: str,
    state: StateDep,
    last_event_id: Annotated[str | None, Header()] = None,
) -> EventStreamResponse:
    """SSE of the job's events; ids are `seq` (n = 1) or `index:seq`; resumes after
    `Last-Event-ID`."""
    record = await jobs.read_record(state.client, job_id)
    resume = jobs.parse_last_event_id(last_event_id)
    stream = jobs.event_stream(
        state.relay, job_id, record.n or 1, resume, state.settings.request_timeout_s
    )
    return EventStreamResponse(stream)


@router.delete("/{job_id}", response_model=JobView)
async def cancel_job(job_id: str, client: ClientDep, response: Response) -> JobView:
    """Cancel: 202 while the job runs or waits (it ends `cancelled`), 200 once it has ended."""
    record = await jobs.read_record(client, job_id)
    ended = record.status is not None and record.status.terminal
    if not ended:
        await client.cancel(job_id)
        response.status_code = 202
    view = jobs.record_view(job_id, record)
    view.cancel_requested = not ended
    return view
