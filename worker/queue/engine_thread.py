"""The engine thread: the one thread that owns the engine.

The event loop hands it commands (add a job, abort requests, stop) through a thread-safe
queue, drained between steps. After each step it posts a `StepResult` (the step's outputs
plus a snapshot of the engine's load) back to the event loop, and goes straight on to the
next step: Redis is never waited on here, so publishing overlaps the next step's compute.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from producer.protocol import ERROR_INVALID_REQUEST, Job
from producer.records import PauseCommand, SleepCommand, WeightsUpdate
from producer.trace_log import TraceLog
from worker.config import EngineConfig
from worker.core.lora_request import LoRARequest
from worker.queue.adapters import ServedAdapters

if TYPE_CHECKING:
    from worker.core.engine import Engine
    from worker.core.multimodal import PreparedImages
    from worker.core.outputs import RequestOutput

logger = logging.getLogger(__name__)

KV_WATERMARK = 0.01  # fraction of KV blocks intake leaves free, as vLLM's scheduler does
PROMPT_EMA_WEIGHT = 0.1  # weight of the newest request in the mean request size


@dataclass(frozen=True)
class AddRequest:
    engine_id: str
    job: Job
    index: int | None = None  # set: run only this completion (n = 1), a resumed n > 1 job
    resume_token_ids: list[int] | None = None  # tokens already sent for it
    # the job's images, read and resized in a thread of their own (None: no images)
    images: Future[PreparedImages | None] | None = None


@dataclass(frozen=True)
class Rejected:
    """A job the engine refused to add."""

    engine_id: str
    error: str
    error_type: str | None  # ERROR_INVALID_REQUEST when the job itself was at fault


@dataclass(frozen=True)
class AbortRequests:
    engine_ids: list[str]


@dataclass
class FollowAdapters:
    registry: dict[str, str]  # the runtime LoRA registry: name -> path


class ResetPrefixCache:
    pass


@dataclass(frozen=True)
class SleepState:
    """The sleep command the engine acted on last (0: none), and its sleep level now (0: awake)."""

    command: int = 0
    level: int = 0


@dataclass(frozen=True)
class PauseState:
    """The pause command the engine acted on last (0: none), and whether it is paused."""

    command: int = 0
    paused: bool = False


@dataclass(frozen=True)
class ServedWeights:
    """The weights update the engine acted on last (0: none), the checkpoint it serves, and
    why that update failed ("": it did not)."""

    update: int = 0
    path: str = ""
    error: str = ""


@dataclass(frozen=True)
class Made:
    """What the engine made of the commands it follows: the pause, the sleep, the weights."""

    pause: PauseState = PauseState()
    sleep: SleepState = SleepState()
    weights: ServedWeights = ServedWeights()


class _Stop:
    pass


@dataclass(frozen=True)
class EngineStats:
    """The engine's load after a step (or after taking commands)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 1
    num_waiting_blocks: int = 0  # blocks the waiting requests still need to start
    num_adds_taken: int = 0  # AddRequest commands taken so far (for in-flight accounting)
    generation_tokens_total: int = 0
    blocks_per_request: int = 1  # blocks a recent request needed to start (moving average)
    spec_decode_num_draft_tokens: int = 0  # guesses computed (speculative decoding), in total
    spec_decode_num_accepted_tokens: int = 0  # guesses kept, in total
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, in total
    prefix_cache_hits: int = 0  # of those, tokens it held (either tier)
    prefix_cache_host_hits: int = 0  # of those, tokens copied back from host memory (KV offloading)
    made: Made = Made()  # (the heartbeat says it once the outputs before it are written)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


@dataclass
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    time: float = 0.0  # unix time the step ended
    error: BaseException | None = None  # the engine failed; the thread has stopped


def intake_capacity(stats: EngineStats, max_num_seqs: int, num_in_flight: int) -> int:
    """How many more jobs to take from the stream now.

    Seats: max_num_seqs minus running, waiting and jobs on their way into the engine. KV
    blocks: the free blocks, less what waiting requests need to start and a small watermark,
    divided by the blocks a recent request took to start. An idle engine always takes one,
    whatever the estimate says, so a long prompt cannot starve."""
    blocks_per_request = max(stats.blocks_per_request, 1)
    seats = max_num_seqs - stats.num_running - stats.num_waiting - num_in_flight
    free_blocks = (
        stats.num_free_blocks
        - stats.num_waiting_blocks
        - int(KV_WATERMARK * stats.num_blocks)
        - num_in_flight * blocks_per_request
    )
    by_blocks = free_blocks // blocks_per_request
    if stats.num_running + stats.num_waiting + num_in_flight == 0:
        by_blocks = max(by_blocks, 1)
    return max(0, min(seats, by_blocks))


class EngineThread:
    """Builds the engine and runs `engine.step()` in one daemon thread; `add`, `abort` and
    `stop` are thread-safe.

    The engine is built in the thread that steps it, not handed in: torch's OpenMP pool
    belongs to the thread that first runs parallel work, and CPU ops run several times
    slower in a second thread once another thread has a pool."""

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop,
                 lora_requests: Mapping[str, LoRARequest] | None = None,
                 base_names: frozenset[str] = frozenset(), trace: TraceLog | None = None) -> None:
        self.config = config
        self.trace = trace  # the per-step trace (None: off)
        self.adapters = ServedAdapters(dict(lora_requests or {}))
        self.base_names = base_names  # `model` names that mean the base model
        self.engine: Engine  # set by the thread, before `start` returns
        self.results: asyncio.Queue[StepResult] = asyncio.Queue()
        self._loop = loop
        self._ready: asyncio.Future[None] = loop.create_future()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._num_adds_taken = 0
        self._initial_registry: dict[str, str] = {}
        self._mean_request_tokens: float | None = None
        # weights updates: the last one asked, the one due (the engine thread's), the jobs held
        # until it is made (mode "wait"), and what the engine serves (read by the heartbeat)
        self.weights_asked = 0
        self._weights_due: WeightsUpdate | None = None
        self._held: list[AddRequest] = []
        self._aborted_held: set[str] = set()  # held jobs aborted meanwhile: aborted once added
        self.weights = ServedWeights()
        # sleep mode: the last command asked, the one due, and the one acted on with the level now
        self.sleep_asked = 0
        self._sleep_level_asked = 0  # (the event loop's: it takes no job from the command on)
        self._sleep_due: SleepCommand | None = None
        self.sleep = SleepState()
        # pause: the last command asked (the event loop's), the one standing (the engine
        # thread's: None once resumed) and the one acted on
        self.pause_asked = PauseCommand(0, False)
        self._pausing: PauseCommand | None = None
        self.pause = PauseState()
        self._thread = threading.Thread(target=self._main, name="genq-engine", daemon=True)
        self._images: ThreadPoolExecutor | None = None  # prepares chat jobs' images

    async def start(self, adapter_registry: dict[str, str] | None = None,
                    weights: WeightsUpdate | None = None, sleep: SleepCommand | None = None,
                    pause: PauseCommand | None = None) -> Engine:
        """Start the thread and wait until the engine is built, with the configured LoRA
        adapters and the runtime registry's (re-raises its error), the weights of the model's
        latest update (`weights`; where they cannot be read, the model's own, and the heartbeat
        says why), and asleep or paused where the model's workers are (`sleep`, `pause`)."""
        self._initial_registry = dict(adapter_registry or {})
        if weights is not None and weights.model_path:
            self.follow_weights(weights)
        elif weights is not None:  # (an update taken back: the model's own weights, which it loads)
            self.weights_asked = weights.count
        if sleep is not None and sleep.level:
            self.follow_sleep(sleep)
        elif sleep is not None:  # (awake: as it starts)
            self.sleep_asked = sleep.count
            self.sleep = SleepState(sleep.count)
        if pause is not None:
            self.follow_pause(pause)
        self._thread.start()
        await self._ready
        return self.engine

    def add(self, request: AddRequest) -> None:
        """Queue a job for the engine. A chat job's images are read, resized and normalized
        meanwhile in another thread: costly work the engine thread would do between steps."""
        engine = getattr(self, "engine", None)  # set once the thread has built it
        if request.job.messages is not None and engine is not None and engine.image_processor is not None:
            request = replace(request, images=self._image_pool().submit(self._prepare_images, request.job))
        self._commands.put(request)

    def _image_pool(self) -> ThreadPoolExecutor:
        if self._images is None:
            self._images = ThreadPoolExecutor(max_workers=2, thread_name_prefix="genq-images")
        return self._images

    def _prepare_images(self, job: Job) -> PreparedImages | None:
        from worker.core.multimodal import chat_media  # loaded by now: the engine imported it

        assert job.messages is not None and self.engine.image_processor is not None
        _, images, modality = chat_media(job.messages)
        if images and modality != self.engine.image_processor.modality:
            raise ValueError(f"this model takes {self.engine.image_processor.modality} parts, not {modality}")
        self.engine.inputs.check_image_count(len(images))  # before any pixels are read
        return self.engine.image_processor.prepare(images) if images else None

    def follow_adapters(self, registry: dict[str, str]) -> None:
        """Serve the runtime LoRA registry's adapters (read in the engine thread)."""
        self._commands.put(FollowAdapters(dict(registry)))

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache (in the engine thread, between steps)."""
        self._commands.put(ResetPrefixCache())

    def follow_weights(self, update: WeightsUpdate) -> None:
        """Serve the checkpoint of a weights update (in the engine thread: at once between two
        steps, or in mode "wait" once the running requests have ended)."""
        self.weights_asked = update.count
        self._commands.put(update)

    def follow_sleep(self, command: SleepCommand) -> None:
        """Sleep (taking no jobs from now on; the engine sleeps once the running ones end) or
        wake (in the engine thread)."""
        self.sleep_asked = command.count
        self._sleep_level_asked = command.level
        self._commands.put(command)

    def follow_pause(self, command: PauseCommand) -> None:
        """Pause (taking no jobs from now on; the engine is paused once its running requests
        ended, at once where they are kept frozen: the event loop aborts them for mode "abort")
        or resume (in the engine thread)."""
        self.pause_asked = command
        self._commands.put(command)

    @property
    def takes_jobs(self) -> bool:
        """False while the engine sleeps or is paused, or is asked to (the event loop's intake
        asks: from the command on, not from when the engine thread takes it; a sleep that
        failed leaves it taking jobs, as it was)."""
        sleep_acted = self._sleep_level_asked == 0 or self.sleep.command == self.sleep_asked
        return self.sleep.level == 0 and sleep_acted and not self.pause_asked.paused

    def abort(self, engine_ids: list[str]) -> None:
        if engine_ids:
            self._commands.put(AbortRequests(list(engine_ids)))

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop after the current step; waits for the thread."""
        self._commands.put(_Stop())
        self._thread.join(timeout_s)
        if self._images is not None:
            self._images.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        """Load snapshot. Only the engine thread calls this once the thread runs."""
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        waiting_blocks = sum(
            max(0, blocks.blocks_needed(r.num_tokens) - blocks.num_held(r.request_id))
            for r in scheduler.waiting
        )
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_free_blocks=blocks.num_free_blocks,
            num_blocks=blocks.num_blocks,
            num_waiting_blocks=waiting_blocks,
            num_adds_taken=self._num_adds_taken,
            generation_tokens_total=self.engine.num_generated_tokens,
            blocks_per_request=blocks.blocks_needed(int(self._mean_request_tokens or 0) + 1),
            spec_decode_num_draft_tokens=self.engine.speculator.stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.engine.speculator.stats.num_accepted_tokens,
            prefix_cache_queries=blocks.stats.queries,
            prefix_cache_hits=blocks.stats.hits,
            prefix_cache_host_hits=blocks.stats.host_hits,
            made=self.made(),
        )

    def made(self) -> Made:
        """What the engine made of the commands so far (the engine thread's, or once it stopped)."""
        return Made(self.pause, self.sleep, self.weights)

    # -- the thread ----------------------------------------------------------------------------

    def _main(self) -> None:
        from worker.core.engine import Engine  # torch: imported once a worker really starts

        try:
            self.engine = Engine(self.config)
            self.weights = ServedWeights(self.weights_asked, str(self.engine.model_path))
            self.adapters.load_configured(self.engine)  # a bad adapter fails the start
            self.adapters.follow(self.engine, self._initial_registry)  # a bad one is noted
            self._take_commands(block=False)  # the latest weights update and sleep, if the model has had them
            self._make_due()
        except BaseException as exc:
            self._loop.call_soon_threadsafe(_fail, self._ready, exc)
            return
        self._post(StepResult(stats=self.stats(), time=time.time()))
        self._loop.call_soon_threadsafe(_succeed, self._ready)
        self._run()

    def _run(self) -> None:
        try:
            while True:
                # (frozen, a step makes nothing due: a sleep waits for the resume, and so does this thread)
                loop_s = time.time()  # (the trace's: how long the commands took before the step)
                busy = self.engine.has_unfinished_requests() and not self._frozen()
                taken = self._take_commands(block=not busy and (self._frozen() or not self._due()))
                if taken is None:
                    return
                rejected, changed = taken
                if self._due() or (self._held and not self._holding()):
                    rejected += self._make_due()
                    changed = True
                if self._frozen():  # (a request aborted meanwhile ends; the others wait)
                    outputs = self.engine.end_aborted()
                elif self.engine.has_unfinished_requests():
                    start_s = time.time()
                    outputs = self.engine.step()
                    if self.trace is not None:
                        self._trace_step(loop_s, start_s, len(outputs))
                else:
                    outputs = []
                if failures := self.engine.take_failures():  # the job fails, with why, not its abort output
                    outputs = [o for o in outputs if o.request_id not in failures]
                    # not the job's fault that we know of (a bad image or processor setting is refused when
                    # added): out of memory, say, or a processor's bug
                    rejected += [Rejected(engine_id, why, None) for engine_id, why in failures.items()]
                self.adapters.retire_unused(self.engine)
                if outputs or changed or rejected:
                    self._post(StepResult(outputs, rejected, self.stats(), time.time()))
        except BaseException as exc:  # reported to the event loop, which stops the worker
            logger.exception("engine thread failed")
            self._post(StepResult(error=exc, time=time.time()))

    def _trace_step(self, loop_s: float, start_s: float, num_outputs: int) -> None:
        """The step's line in the trace: when it ran, what it carried, the engine's load after."""
        end_s = time.time()
        shape, scheduler = self.engine.last_step, self.engine.scheduler
        assert self.trace is not None
        self.trace.write("step", start=start_s, end=end_s, ms=round((end_s - start_s) * 1000, 3),
                         commands_ms=round((start_s - loop_s) * 1000, 3), decodes=shape.decode_tokens,
                         prefill_tokens=shape.prefill_tokens, prefill_budget=shape.prefill_budget,
                         running=len(scheduler.running), waiting=len(scheduler.waiting), outputs=num_outputs)

    def _take_commands(self, block: bool) -> tuple[list[Rejected], bool] | None:
        """Apply queued commands; wait for one first when the engine is idle. Returns
        (rejected adds, whether anything was taken), or None on stop."""
        rejected: list[Rejected] = []
        changed = False
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return rejected, changed
            block, changed = False, True
            if isinstance(command, _Stop):
                return None
            if isinstance(command, AddRequest) and self._holding():
                self._held.append(command)
            elif isinstance(command, AddRequest):
                if (refused := self._add(command)) is not None:
                    rejected.append(refused)
            else:
                self._follow(command)

    def _follow(self, command: Any) -> None:
        """Act on a command other than an add or a stop (or note it due)."""
        if isinstance(command, AbortRequests):
            for engine_id in command.engine_ids:
                if any(h.engine_id == engine_id for h in self._held):  # (its job ends as any aborted one)
                    self._aborted_held.add(engine_id)
                self.engine.abort_request(engine_id)
        elif isinstance(command, WeightsUpdate):
            self._weights_due = command
        elif isinstance(command, SleepCommand):
            self._sleep_due = command
        elif isinstance(command, PauseCommand):
            self._pausing = command if command.paused else None
            if not command.paused:
                self.pause = PauseState(command.count, False)
                logger.info("resumed, as asked (command %d)", command.count)
        elif isinstance(command, FollowAdapters):
            self.adapters.follow(self.engine, command.registry)
        elif isinstance(command, ResetPrefixCache):
            self.engine.reset_prefix_cache()

    def _due(self) -> bool:
        """Whether a weights update, a sleep or wake, or a pause is yet to be made."""
        pausing = self._pausing
        return (self._weights_due is not None or self._sleep_due is not None
                or (pausing is not None and self.pause.command != pausing.count))

    def _frozen(self) -> bool:
        """Whether a pause keeps the requests frozen: no step runs them until the resume."""
        return self._pausing is not None and self._pausing.frozen

    def _holding(self) -> bool:
        """Whether jobs wait to be added: for a weights update in mode "wait", or a sleep, to be
        made once the running ones end, or while the engine sleeps or is paused."""
        weights, sleep = self._weights_due, self._sleep_due
        return ((weights is not None and weights.mode == "wait") or (sleep is not None and sleep.level > 0)
                or self.engine.weights.is_sleeping() or self._pausing is not None)

    def _make_due(self) -> list[Rejected]:
        """Make the weights update and the sleep or wake that are due, where they may be made
        now (a sleep, an update in mode "wait": once no request runs); then add the jobs held
        for them, unless the engine sleeps. The jobs the engine refused."""
        self._update_weights()
        self._sleep_or_wake()
        self._pause_if_due()
        if self._holding() or not self._held:
            return []
        held, self._held = self._held, []
        rejected = []
        for request in held:
            if (refused := self._add(request)) is not None:
                rejected.append(refused)
            elif request.engine_id in self._aborted_held:
                self.engine.abort_request(request.engine_id)
        self._aborted_held.clear()
        return rejected

    def _sleep_or_wake(self) -> None:
        command = self._sleep_due
        if command is None or (command.level and self.engine.has_unfinished_requests()):
            return
        self._sleep_due = None
        try:
            if command.level:
                self.engine.weights.sleep(command.level)
            else:
                self.engine.weights.wake_up(list(command.tags))
        except Exception as exc:  # (waking weights from a checkpoint that went away, say): as it was
            logger.error("sleep command %d (level %d, %s) failed: %s", command.count, command.level,
                         ",".join(command.tags), exc)
        else:
            logger.info("asleep (level %d), as asked" if command.level else "woke %s, as asked",
                        command.level or " and ".join(command.tags))
        self.sleep = SleepState(command.count, command.level or self.sleep.level if self.engine.weights.is_sleeping() else 0)

    def _pause_if_due(self) -> None:
        """Be paused once no request runs, or at once where the pause keeps them frozen."""
        command = self._pausing
        if (command is None or self.pause.command == command.count
                or (not command.frozen and self.engine.has_unfinished_requests())):
            return
        self.pause = PauseState(command.count, True)
        logger.info("paused (mode %s), as asked (command %d)", command.mode, command.count)

    def _update_weights(self) -> None:
        """Make the weights update that is due, if it may be made now (mode "wait": once no
        request runs, or while a pause keeps them frozen: they go on over the new weights)."""
        due = self._weights_due
        if due is None or (due.mode == "wait" and self.engine.has_unfinished_requests() and not self._frozen()):
            return
        self._weights_due = None
        try:
            path = self.engine.weights.reload(due.model_path or None)  # ("": the model's own, read again)
            self.weights = ServedWeights(due.count, str(path))
        except Exception as exc:  # the checkpoint's fault: the weights are as they were
            logger.error("weights update %d (%s) failed, serving %s on: %s", due.count, due.model_path,
                         self.weights.path, exc)
            self.weights = replace(self.weights, update=due.count, error=str(exc) or type(exc).__name__)

    def _add(self, request: AddRequest) -> Rejected | None:
        """Queue one request; why, if the engine refuses it."""
        self._num_adds_taken += 1
        job = request.job
        params = job.sampling_params
        if request.index is not None:  # one completion of n, seeded as the engine seeds it
            seed = None if params.seed is None else params.seed + request.index
            params = replace(params, n=1, seed=seed)
        lora = self.adapters.served.get(job.model) if job.model else None
        if job.model and lora is None and job.model not in self.base_names:
            # Race prevented: an adapter unloaded between intake's check and this add; the
            # job must not quietly run on the base model.
            return Rejected(request.engine_id, f"model {job.model!r} is not served by this worker "
                            "(the LoRA adapter was unloaded)", ERROR_INVALID_REQUEST)
        try:
            self.engine.add_request(
                request.engine_id, self._prompt(job, request.images), params, priority=job.priority,
                resume_output_token_ids=request.resume_token_ids or None, lora_request=lora,
                pooling_params=job.pooling_params,
            )
        except (ValueError, TemplateError) as exc:  # the job's fault: prompt, params, messages
            return Rejected(request.engine_id, str(exc), ERROR_INVALID_REQUEST)
        except Exception as exc:  # a bad prompt fails its job; the engine is left as it was
            return Rejected(request.engine_id, f"{type(exc).__name__}: {exc}", None)
        self._note_size(request)
        return None

    def _note_size(self, request: AddRequest) -> None:
        """Keep a moving average of request sizes (prompt + resumed tokens) for intake."""
        parent = self.engine.output_processor.parents.get(request.engine_id)
        if parent is None:
            return
        size = len(parent.prompt_token_ids) + len(request.resume_token_ids or ())
        mean = self._mean_request_tokens
        self._mean_request_tokens = size if mean is None else mean + PROMPT_EMA_WEIGHT * (size - mean)

    def _prompt(self, job: Job, images: Future[PreparedImages | None] | None = None) -> Any:
        prompt = self._job_prompt(job, images)
        if job.cache_salt is None:
            return prompt
        return {**(prompt if isinstance(prompt, dict) else {"prompt": prompt}), "cache_salt": job.cache_salt}

    def _job_prompt(self, job: Job, images: Future[PreparedImages | None] | None) -> Any:
        if job.messages is not None:
            prompt = self.engine.inputs.apply_chat_template(
                job.messages, tools=job.tools, **(job.chat_template_kwargs or {})
            )
            prepared = images.result() if images is not None else None  # raises what reading them raised
            processor = self.engine.image_processor
            if prepared is None or processor is None:
                return prompt
            return {**prompt, "multi_modal_data": {processor.modality: prepared}}
        if job.prompt_token_ids is not None:
            return {"prompt_token_ids": job.prompt_token_ids}
        if job.prompt_embeds is not None:
            return {"prompt_embeds": job.prompt_embeds}
        return job.prompt

    def _post(self, result: StepResult) -> None:
        try:
            self._loop.call_soon_threadsafe(self.results.put_nowait, result)
        except RuntimeError:  # the loop closed during shutdown; nobody is listening
            pass


def _succeed(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _fail(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
