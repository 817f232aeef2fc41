"""Turns sampled tokens into `RequestOutput`s: incremental detokenization, stop strings, and
the grouping of `n > 1` completions under their parent request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from worker.core.detokenizer import IncrementalDetokenizer
from worker.core.outputs import CompletionOutput, RequestOutput
from worker.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from worker.sample.sampler import TokenLogprobs


@dataclass(slots=True)
class CompletionState:
    index: int
    detokenizer: IncrementalDetokenizer
    num_sent_tokens: int  # output tokens already reported
    finished: bool = False


@dataclass(slots=True)
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: dict[str, CompletionState] = field(default_factory=dict)  # child id -> state
    prompt_logprobs: list[Any] | None = None  # per prompt position, filled as chunks compute
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served, for usage reports
    given_embeds: bool = False  # the prompt came as embeddings: its ids are the engine's placeholders
    num_prompt_tokens: int = 0  # len(prompt_token_ids) (each output carries it: not the list's read a step)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions.values())


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.parent_of: dict[str, str] = {}  # child request id -> parent request id
        # child request id -> its parent's state and its own (process's one lookup a request)
        self._states: dict[str, tuple[ParentState, CompletionState]] = {}

    def add_request(self, parent_id: str, prompt: str | None, children: list[Request]) -> None:
        first = children[0]
        state = ParentState(parent_id, prompt, first.prompt_token_ids, given_embeds=first.given_embeds,
                            num_prompt_tokens=len(first.prompt_token_ids))
        for index, child in enumerate(children):
            detok = IncrementalDetokenizer(
                self.tokenizer, child.prompt_token_ids, child.sampling_params, child.output_token_ids
            )
            completion = state.completions[child.request_id] = CompletionState(index, detok, child.num_output_tokens)
            self.parent_of[child.request_id] = parent_id
            self._states[child.request_id] = (state, completion)
        self.parents[parent_id] = state

    def child_ids(self, parent_id: str) -> list[str]:
        state = self.parents.get(parent_id)
        return list(state.completions) if state else []

    def prompt_logprobs_of(self, request_id: str, num_prompt_tokens: int) -> list[Any]:
        parent = self.parents[self.parent_of[request_id]]
        if parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None] * num_prompt_tokens
        return parent.prompt_logprobs

    def process(
        self, updated: list[Request], logprobs: dict[str, list[TokenLogprobs]] | None = None,
        timestamps_of: Callable[[Request, str | None], list[float] | None] | None = None,
    ) -> tuple[list[RequestOutput], list[str]]:
        """Deltas for requests that got tokens or finished this step, and the ids of requests
        that a stop string finished (the engine tells the scheduler); `timestamps_of(request,
        finish reason)`: a finished request's token timestamps (Whisper's) for its final delta,
        asked once its tokens are final (a stop string's cut made)."""
        outputs: list[RequestOutput | None] = []
        # a parent of several completions (n > 1): its output's place and its deltas, gathered
        grouped: dict[str, tuple[int, list[CompletionOutput]]] = {}
        stopped: list[str] = []
        states = self._states
        for request in updated:
            found = states.get(request.request_id)
            if found is None:
                continue
            parent, state = found
            if request.num_cached_tokens > parent.num_cached_tokens:
                parent.num_cached_tokens = request.num_cached_tokens
            delta = self._completion_delta(request, state, logprobs.get(request.request_id) if logprobs else None)
            if delta.finish_reason is not None:
                if delta.finish_reason == "stop" and delta.stop_reason is not None and not request.is_finished:
                    stopped.append(request.request_id)
                if timestamps_of is not None:
                    delta.token_timestamps = timestamps_of(request, delta.finish_reason)
            if len(parent.completions) == 1:  # (n = 1, the common request: its output at once, no grouping)
                outputs.append(self._request_output(parent, [delta]))
            elif parent.request_id in grouped:
                grouped[parent.request_id][1].append(delta)
            else:
                grouped[parent.request_id] = (len(outputs), [delta])
                outputs.append(None)  # (its place: the parents' order is that of their first delta)
        for parent_id, (place, deltas) in grouped.items():
            outputs[place] = self._request_output(self.parents[parent_id], deltas)
        return cast("list[RequestOutput]", outputs), stopped

    def _completion_delta(self, request: Request, state: CompletionState,
                          logprobs: list[TokenLogprobs] | None) -> CompletionOutput:
        output_ids = request.output_token_ids
        new_ids = output_ids[state.num_sent_tokens :]
        # (a running request, the common case, has no finish reason and all its tokens are text)
        finish_reason = None if request.status is RequestStatus.RUNNING else request.status.finish_reason
        detok = state.detokenizer
        if new_ids:
            text = detok.update(new_ids if finish_reason is None else _text_ids(request, new_ids))
        else:
            text = ""
        stop_reason = request.stop_reason
        if detok.stop_reason is not None:
            finish_reason, stop_reason = "stop", detok.stop_reason
            # several tokens in one step (speculative decoding): those after the one that
            # completed the stop string are not output
            del output_ids[detok.num_tokens_at_stop :]
            new_ids = output_ids[state.num_sent_tokens :]
        elif finish_reason is not None:
            text += detok.flush()
        state.num_sent_tokens = len(output_ids)
        state.finished = finish_reason is not None
        if logprobs:
            logprobs = logprobs[: len(new_ids)]  # tokens a stop left out
            for entry in logprobs:
                self._spell(entry)
        return CompletionOutput(state.index, text, new_ids, finish_reason, stop_reason, logprobs or None)

    def _request_output(self, parent: ParentState, deltas: list[CompletionOutput]) -> RequestOutput:
        parent_id = parent.request_id
        # (a completion that goes on, this step's last one the most often, settles it cheaply)
        finished = deltas[-1].finish_reason is not None and parent.finished
        if finished:
            del self.parents[parent_id]
            for child_id in parent.completions:
                self.parent_of.pop(child_id, None)
                self._states.pop(child_id, None)
        out = RequestOutput(parent_id, parent.prompt, [] if parent.given_embeds else parent.prompt_token_ids, deltas,
                            finished, num_cached_tokens=parent.num_cached_tokens,
                            num_prompt_tokens=parent.num_prompt_tokens)
        if parent.prompt_logprobs is not None and not parent.prompt_logprobs_sent:
            out.prompt_logprobs, parent.prompt_logprobs_sent = parent.prompt_logprobs, True
            for entry in out.prompt_logprobs:
                if entry is not None:
                    self._spell(entry)
            if out.prompt is None:  # token ids in: the text that goes with their logprobs
                out.prompt = self.tokenizer.decode(parent.prompt_token_ids)
        return out

    def _spell(self, logprobs: TokenLogprobs) -> None:
        """Each token of a logprobs entry as its own text: what an API shows for it."""
        ids = list(dict.fromkeys([logprobs.token_id, *logprobs.top_logprobs]))
        texts = self.tokenizer.batch_decode([[i] for i in ids])
        logprobs.decoded = dict(zip(ids, texts, strict=True))


def _text_ids(request: Request, new_ids: list[int]) -> list[int]:
    """The token that stopped a request (EOS or a stop token id) is not part of its text
    unless include_stop_str_in_output asks for it, as in vLLM."""
    stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED and request.output_token_ids
    if stopped_by_token and not request.sampling_params.include_stop_str_in_output:
        return new_ids[:-1]
    return new_ids
