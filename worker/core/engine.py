"""The engine: requests in, `RequestOutput` deltas out, one `step()` at a time.

Not thread-safe: one thread owns the engine and calls `step()`; other threads hand it work
through that thread (the worker's intake queue does this).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from producer.pooling_params import PoolingParams
from producer.sampling_params import SamplingParams
from worker.config import EngineConfig, SchedulerConfig
from worker.core.block_manager import BlockManager
from worker.core.generation_config import generation_config_of, generation_eos, sampling_defaults
from worker.core.input_processor import (
    InputProcessor,
    PromptInput,
    cache_salt_of,
    check_fits,
    read_chat_template,
)
from worker.core.lora_request import LoRARequest
from worker.core.multimodal import (
    image_processor,
    takes_images,
)
from worker.core.output_processor import OutputProcessor
from worker.core.outputs import RequestOutput
from worker.core.prompt_embeds import (
    embeds_digest,
)
from worker.core.request import Request, RequestStatus
from worker.core.scheduler import Scheduler, SchedulerOutput
from worker.core.step_cost import StepCostModel
from worker.core.weights import Weights
from worker.guided.structured_output import GuidedDecoding
from worker.model_executor.model_loader import check_import_names, read_config, resolve_model_path
from worker.model_executor.model_runner import ModelRunner
from worker.model_executor.models.config import ModelConfig, architecture_of, language_config
from worker.model_executor.models.mtp import check_has_mtp
from worker.model_executor.models.whisper import CHAT_TEMPLATE as WHISPER_CHAT_TEMPLATE
from worker.model_executor.models.whisper import ENGLISH_CHAT_TEMPLATE as WHISPER_ENGLISH_TEMPLATE
from worker.model_executor.models.whisper import token_timestamps, whisper_rules
from worker.model_executor.parallel import ParallelRunner
from worker.model_executor.tokenizer_loader import load_tokenizer
from worker.sample.logits_processors import LogitsProcessors, load_logits_processors
from worker.sample.sampler import Sampler, SamplerOutput, TokenLogprobs
from worker.sample.sampling_batch import SamplingBatch
from worker.sample.thinking_budget import ThinkingBudgets, ThinkingMarkers
from worker.spec_decode.speculative import (
    MTP_METHODS,
)
from worker.spec_decode.speculator import Speculator, make_proposer

logger = logging.getLogger(__name__)

MAX_FAILURES = 1024  # failed requests' reasons kept for take_failures, latest last
# step-time-aware chunking gives way to the static budget while more prompt tokens wait than
# this many steps of it take: a burst (W1 sent to a worker) would otherwise start its decodes a
# few dozen prompt tokens a step, at small batches (13.5% fewer tokens/s at max_step_ms 20)
BACKLOG_BUDGETS = 2


class StepShape(NamedTuple):
    """What the last step carried: its decode and prompt tokens, and the prompt tokens the
    step-time model allowed it (None: no target, the static budget)."""

    decode_tokens: int = 0
    prefill_tokens: int = 0
    prefill_budget: int | None = None


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        check_import_names()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_path = resolve_model_path(config.model, config.cache_dir)
        whole_config = read_config(self.model_path, config.hf_overrides)
        hf_config = language_config(whole_config)
        self.tokenizer = load_tokenizer(config.tokenizer, self.model_path)
        if config.chat_template is not None:  # (the workers publish it with the tokenizer)
            self.tokenizer.chat_template = read_chat_template(config.chat_template)
        # (before the model loads: a processor that cannot load fails the start at once)
        self.logits_processors = LogitsProcessors(load_logits_processors(config.logits_processors, config))
        self.max_model_len = _max_model_len(config, hf_config)
        if (config.speculative_config or {}).get("method") in MTP_METHODS:  # before the model loads
            check_has_mtp(hf_config)
        images = takes_images(self.model_path, whole_config)
        self.runner: ModelRunner | ParallelRunner
        image_config = whole_config if images else None
        model_class = encoder_decoder_class(config, whole_config, images)  # (which refuses tensor parallelism)
        if config.tensor_parallel_size == 1:
            own_class: dict[str, Any] = {} if model_class is None else {"model_class": model_class}
            self.runner = ModelRunner(config, self.model_path, hf_config, self.max_model_len, image_config, **own_class)
        else:
            # the model's split is checked before any other rank starts
            ModelConfig.from_hf(hf_config, config.quantization, self.max_model_len).shard(
                config.tensor_parallel_size, config.enable_expert_parallel)
            self.runner = ParallelRunner(config, self.model_path, hf_config, self.max_model_len, image_config)
        self.alignment_heads: list[tuple[int, int]] = []  # (layer, head): Whisper's, its token timestamps'
        self.median_filter_width = 7
        if model_class is not None:
            self._take_whisper_rules(config, whole_config)
        # where the model takes images: what makes their pixels and tokens
        self.image_processor = (image_processor(self.model_path, whole_config, self.tokenizer, config.mm_processor_kwargs)
                                if images else None)
        self.model_config = self.runner.model_config
        self.inputs = InputProcessor(config, self.tokenizer, self.model_config, self.max_model_len,
                                     self.image_processor, self.alignment_heads, whisper=model_class is not None)
        self.eos_token_ids = (self.model_config.eos_token_ids | _tokenizer_eos(self.tokenizer)
                              | generation_eos(self.model_path))
        self.sampling_defaults = sampling_defaults(self.model_path, config.generation_config,
                                                   config.override_generation_config)
        # linear attention's state follows every token before: blocks alone restore no prefix, the
        # states the prefix cache keeps do (where it keeps some)
        self.recurrent = self.model_config.linear is not None
        num_saved = self.runner.states.num_saved if self.runner.states is not None else None
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching and num_saved != 0,
                                          windows=[window for window, _ in self.runner.kv_layout],
                                          num_host_blocks=self.runner.num_host_blocks,
                                          state_slots=num_saved, state_interval=config.state_interval,
                                          num_host_states=self.runner.num_host_states)
        sched_config = SchedulerConfig(
            max_num_seqs=self.runner.max_num_seqs,  # (fewer where Whisper's slots do not fit)
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            eos_token_ids=frozenset(self.eos_token_ids),
            max_loras=config.max_loras if config.enable_lora else 0,
            recurrent=self.recurrent,
        )
        self.scheduler = Scheduler(sched_config, self.block_manager)
        # step-time-aware chunking: what a step costs, learned from the steps run (max_step_ms)
        self.step_cost = StepCostModel() if config.max_step_ms else None
        self.last_step = StepShape()
        self.max_num_seqs = sched_config.max_num_seqs
        # (Whisper's logprobs are its rules' before the temperature: what its decoders weigh a reply by)
        self.sampler = Sampler(seed=config.seed, use_kernel=self.runner.model.use_kernels,
                               logprobs_mode=config.logprobs_mode, before_temperature=model_class is not None)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.guided = GuidedDecoding(self.tokenizer, self.eos_token_ids, self.model_config.vocab_size)
        self.thinking = ThinkingBudgets(ThinkingMarkers.from_config(config.reasoning_config, self.tokenizer))
        self.generators: dict[str, torch.Generator] = {}
        self.speculator = Speculator(make_proposer(config, self.runner, self.model_path, self.max_model_len),
                                     self.scheduler, self.guided, self.generators, self.max_model_len,
                                     jump_forward=self.runner.states is None)
        self._aborted: list[Request] = []  # finished by abort, reported at the next step
        # async_scheduling: the last step's requests whose outputs are still to be made, with
        # their logprobs and embeddings (made while the next step runs)
        self._pending: tuple[list[Request], dict[str, list[TokenLogprobs]], dict[str, list[float]]] | None = None
        # the last step's sampling batch, its rows' requests and whether it had guided rows' masks,
        # where the next may reuse it (_reused_batch)
        self._static_batch: tuple[list[Request], SamplingBatch, bool] | None = None
        # request id -> why it failed in a step (its images' encoding, a logits processor)
        self._failures: dict[str, str] = {}
        self.num_generated_tokens = 0
        self.weights = Weights(config, self.model_path, self.max_model_len, self.runner, self.speculator.proposer,
                               self.reset_prefix_cache, self._num_unfinished)

    # -- intake --------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        resume_output_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for a bad prompt, parameters or adapter, leaving
        the engine as it was. `resume_output_token_ids` continues a job from tokens it had
        already emitted: they count towards max_tokens and are not reported again.
        `lora_request` runs it with that adapter, read on first use. With `pooling_params`
        it is an embedding request: its one output carries `embedding`, and no tokens."""
        params = params or SamplingParams()
        self._check_takes(request_id)
        text, prompt_ids, images, embeds = self.inputs.check_prompt(prompt, params, pooling_params)
        if pooling_params is None and not params.clamp_max_tokens:  # (an embedding generates nothing)
            check_fits(len(prompt_ids), params.max_tokens, self.max_model_len)
        salt = cache_salt_of(prompt)
        predicted = self.tokenizer.encode(params.prediction, add_special_tokens=False) if params.prediction else []
        if pooling_params is not None and params.n != 1:
            raise ValueError(f"an embedding request has one output, got n={params.n}")
        if pooling_params is not None and pooling_params.dimensions is not None:
            self.inputs.check_dimensions(pooling_params.dimensions)
        if pooling_params is None and not self.model_config.has_lm_head:
            raise ValueError(f"this model ({self.model_config.architecture}) has no LM head: it serves "
                             "embedding requests only")
        self.inputs.check_params(params)
        self.thinking.check(params.thinking_token_budget)
        grammar = self.guided.compile(params.guided_decoding) if params.guided_decoding is not None else None
        functions = self.logits_processors.make(params, params.n)  # (a refusal leaves nothing behind)
        lora_id = self.add_lora(lora_request) if lora_request is not None else 0
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        children = [
            self._make_child(request_id, i, prompt_ids, params, priority, arrival_time, resume_output_token_ids, grammar)
            for i in range(params.n)
        ]
        bad_words = self.inputs.bad_words_token_ids(params.bad_words or [])
        digest = embeds_digest(embeds) if embeds is not None else 0
        for child in children:
            child.lora_id, child.cache_salt, child.prediction_token_ids = lora_id, salt, predicted
            child.pooling_params = pooling_params
            child.bad_words_token_ids = bad_words
            child.image_spans = images.span_keys() if images is not None else []
            if images is not None and self.image_processor is not None and self.image_processor.both_ways:
                child.whole_spans = images.embed_ranges()
            if embeds is not None:  # (its blocks keyed by the embeddings, as an image's by its pixels)
                child.image_spans, child.given_embeds = [(0, len(prompt_ids), digest)], True
        if images is not None:
            self.runner.add_images([child.request_id for child in children], images)
        if embeds is not None:
            self.runner.add_prompt_embeds([child.request_id for child in children], embeds, digest)
        self.output_processor.add_request(request_id, text, children)
        self.logits_processors.keep([child.request_id for child in children], functions)
        for child in children:
            self.thinking.add(child.request_id, params.thinking_token_budget, prompt_ids)
        if self.recurrent and not self.block_manager.enable_prefix_caching:  # no state of the prompt is
            # kept for the others to start from: each completion computes it
            for child in children:
                self.scheduler.add_request(child)
        else:
            self.scheduler.add_request(children[0], forks=children[1:])

    def _check_takes(self, request_id: str) -> None:
        if self.runner.asleep:
            raise ValueError("the engine is asleep (sleep mode): wake_up() first")
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in the engine")

    def _make_child(self, request_id, index, prompt_ids, params, priority, arrival_time, resume, grammar):
        child_id = request_id if params.n == 1 else f"{request_id}#{index}"
        child_params = params
        if params.seed is not None:
            child_params = replace(params, seed=params.seed + index)
            self.generators[child_id] = self._seeded_generator(child_params, len(resume or []))
        request = Request(
            request_id=child_id,
            prompt_token_ids=list(prompt_ids),
            sampling_params=child_params,
            priority=priority,
            arrival_time=arrival_time,
            output_token_ids=list(resume or []),
        )
        if grammar is not None:
            self.guided.add(child_id, grammar)
        room = self.max_model_len - len(prompt_ids)  # (past it only with clamp_max_tokens: check_fits)
        request.max_tokens = min(params.max_tokens or room, room)
        return request

    def _seeded_generator(self, params: SamplingParams, num_drawn: int) -> torch.Generator:
        """A request's own generator. A resumed request skips the draws its first run made
        (one vocabulary-sized draw per random token), so it continues with the same tokens."""
        assert params.seed is not None, "only seeded requests get their own generator"
        generator = torch.Generator().manual_seed(params.seed)
        if num_drawn and not params.greedy:
            torch.empty(num_drawn, self.model_config.vocab_size).exponential_(generator=generator)
        return generator

    def add_lora(self, lora_request: LoRARequest) -> int:
        """Read an adapter (once per id) so requests can run with it; returns its id.
        ValueError when LoRA is off or the adapter does not fit this model."""
        if self.runner.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is not enabled "
                             "(start the engine with enable_lora=True)")
        self.runner.lora.add(lora_request)
        return lora_request.lora_int_id

    def remove_lora(self, lora_id: int) -> None:
        """Forget an adapter no request runs with any more (its id may not be reused)."""
        if self.runner.lora is not None:
            self.runner.lora.remove(lora_id)

    def reset_prefix_cache(self) -> None:
        """vLLM's: forget every cached prefix (KV blocks, saved states, the host tier's). Those
        running requests hold stay theirs, but no later request is served from them. For
        benchmarks that must start cold, and after anything that should not be served from
        memory (new weights)."""
        for request in self.scheduler.waiting:  # (one holding no blocks hashes its prompt again, anew)
            if not self.block_manager.num_held(request.request_id):
                request.block_hashes.clear()
        self.block_manager.reset_prefix_cache()

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its final output (finish_reason 'abort')
        comes from the next step."""
        child_ids = self.output_processor.child_ids(request_id) or [request_id]
        self._aborted.extend(self.scheduler.abort_requests(child_ids))

    def _take_whisper_rules(self, config: EngineConfig, whole_config: Any) -> None:
        """Whisper's prompts as chats (its template, unless one is given), transformers'
        generation rules of the checkpoint (WhisperRules, a logits processor every request
        has), and the cross-attention heads its token timestamps are found by."""
        generation = generation_config_of(self.model_path)
        self.alignment_heads = [(int(layer), int(head)) for layer, head in generation.get("alignment_heads") or []]
        self.median_filter_width = int(getattr(whole_config, "median_filter_width", 7))
        if config.chat_template is None:
            english_only = not generation.get("is_multilingual", True)
            self.tokenizer.chat_template = WHISPER_ENGLISH_TEMPLATE if english_only else WHISPER_CHAT_TEMPLATE
        rules = whisper_rules(generation, self.tokenizer, self.runner.model_config.vocab_size)
        self.logits_processors.processors.append(("whisper", rules))

    # -- stepping ------------------------------------------------------------------------------

    def _num_unfinished(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted) or self._pending is not None

    def step(self) -> list[RequestOutput]:
        """One step: the outputs of the requests it moved. With async_scheduling, those of the
        step before, made while this one runs on the device (its own come out of the next)."""
        start_s = time.perf_counter()
        budget = self._prefill_budget()
        sched = self.scheduler.schedule(budget)
        # what the step carries, for the per-step trace (worker.queue.engine_thread)
        self.last_step = StepShape(sched.num_decode_tokens, sched.num_prefill_tokens, budget)
        if sched.swaps:  # (whether or not a request is left to run)
            self.runner.swap_blocks(sched.swaps)
        self.speculator.before_step(sched)
        updated: list[Request] = self._take_aborted()
        logprobs: dict[str, list[TokenLogprobs]] = {}
        embeddings: dict[str, list[float]] = {}
        moved: list[Request] = []
        for request_id in sched.preempted:
            self.runner.forget(request_id, preempted=True)
        if not sched.is_empty and (failed := self.runner.encode_images(sched.scheduled)):
            updated += self._drop_unencoded(sched, failed)
        model_out = self.runner.execute(sched) if not sched.is_empty else None
        outputs = self._take_pending()  # (the device runs this step meanwhile)
        if model_out is not None:
            sampled, logprobs, failed = self._sample(sched, model_out.request_ids, model_out.logits)
            self._rewind_wrong_guesses(sched, sampled)
            self._record_prompt_logprobs(sched, model_out.chunk_logits)
            updated += self._end_failed(failed, sampled, logprobs)
            moved = self._update(sched, sampled)
            updated += moved
            self.speculator.after_step(sched, model_out, sampled)
            embeddings = self._pool(model_out.pooled)
            updated += [self.scheduler_request(rid) for rid in embeddings]
        if self.config.async_scheduling and (updated or model_out is not None):
            self._pending = (updated, logprobs, embeddings)
        else:
            outputs += self._make_outputs(updated, logprobs, embeddings)
        self.speculator.propose()
        if self.guided.states:  # (their next masks, filled while the next step runs)
            self.guided.prefetch([(r.request_id, r.output_token_ids) for r in moved if not r.is_finished])
        if self.step_cost is not None and not sched.is_empty:
            self.step_cost.observe(time.perf_counter() - start_s, sched.num_decode_tokens, sched.num_prefill_tokens)
        return outputs

    def _prefill_budget(self) -> int | None:
        """The prompt tokens the next step may carry to stay under max_step_ms with its
        decodes, by the cost model (None: no target, the static budget alone)."""
        if self.step_cost is None or self.config.max_step_ms is None:
            return None
        if self.scheduler.num_prompt_tokens_pending() > BACKLOG_BUDGETS * self.config.max_num_batched_tokens:
            return None  # a backlog (a burst of prompts): throughput first, as offline
        return self.step_cost.prefill_budget(self.config.max_step_ms / 1000, self.scheduler.num_decode_tokens(),
                                             floor=self.config.block_size,
                                             ceiling=self.config.max_num_batched_tokens)

    def _take_pending(self) -> list[RequestOutput]:
        """The outputs of the step before, where they wait (async_scheduling)."""
        if self._pending is None:
            return []
        pending, self._pending = self._pending, None
        return self._make_outputs(*pending)

    def _make_outputs(self, updated: list[Request], logprobs: dict[str, list[TokenLogprobs]],
                      embeddings: dict[str, list[float]]) -> list[RequestOutput]:
        """The deltas of the requests a step moved: detokenized, stop strings checked (those a
        stop string ends, end), embeddings attached; the requests that ended are forgotten."""
        outputs, stopped = self.output_processor.process(updated, logprobs, self._token_timestamps)
        if embeddings:
            for output in outputs:
                output.embedding = embeddings.get(output.request_id)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        running = RequestStatus.RUNNING  # (most of them: not the finished-status set's lookup)
        self._forget([r for r in updated if r.status is not running and r.is_finished or r.request_id in stopped])
        return outputs

    def end_aborted(self) -> list[RequestOutput]:
        """The final outputs of the requests aborted since the last step (and the outputs of
        that step, where they wait), without stepping the others (an engine whose requests are
        kept frozen: a pause with mode "keep")."""
        outputs = self._take_pending()
        aborted = self._take_aborted()
        more, _ = self.output_processor.process(aborted, {}, self._token_timestamps)
        self._forget(aborted)
        return outputs + more

    def _rewind_wrong_guesses(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """A model with states took in every guess of the step: where one was wrong, each such
        request's state goes back to the one after its known tokens (the guesses it keeps are
        computed again by its next step, before that step's own guesses: SchedulerConfig.recurrent)."""
        states = self.runner.states
        if states is None:
            return
        for s in sched.scheduled:
            if (s.num_drafts and len(sampled.get(s.request_id, ())) <= s.num_drafts
                    and s.request_id in self.scheduler.requests):  # (not one that ended meanwhile)
                states.rewind(s.request_id)

    def _drop_unencoded(self, sched: SchedulerOutput, failed: dict[str, Exception]) -> list[Request]:
        """Requests whose images the encoder failed on end now (finish_reason abort), out of
        this step (_fail). The rest of the batch runs."""
        for request_id, exc in failed.items():
            logger.error("request %s: its images could not be encoded, so it ends: %r", request_id, exc)
        ended = self._fail({rid: f"its images could not be encoded: {type(exc).__name__}: {exc}"
                            for rid, exc in failed.items()})
        sched.scheduled = [s for s in sched.scheduled if s.request_id not in ended]
        return self.scheduler.abort_requests(ended)

    def _end_failed(self, failed: dict[str, str], sampled: dict[str, list[int]],
                    logprobs: dict[str, list[TokenLogprobs]]) -> list[Request]:
        """Requests a logits processor failed on (`failed`: why) end now, what they sampled this
        step unkept (_fail)."""
        if not failed:
            return []
        for request_id, why in failed.items():
            logger.warning("request %s ends: %s", request_id, why)
        ended = self._fail(failed)
        for request_id in ended:
            sampled.pop(request_id, None)
            logprobs.pop(request_id, None)
        return self.scheduler.abort_requests(ended)

    def _fail(self, why: dict[str, str]) -> list[str]:
        """Record why each request failed, by the id it was added with (take_failures); the ids
        of the requests that end with it: its prompt's other samples too (they would only
        fail the same way, and a job fails whole)."""
        ended: list[str] = []
        for request_id, reason in why.items():
            parent = self.output_processor.parent_of.get(request_id, request_id)
            self._failures[parent] = reason
            ended += self.output_processor.child_ids(parent) or [request_id]
        while len(self._failures) > MAX_FAILURES:  # offline, nobody takes them
            self._failures.pop(next(iter(self._failures)))
        return ended

    def take_failures(self) -> dict[str, str]:
        """The requests (by the ids they were added with) that ended since the last call
        because a step failed on them (the encoder on their images, a logits processor), and
        why; with async_scheduling, once their final outputs are out (the step after)."""
        waiting = set() if self._pending is None else {
            self.output_processor.parent_of.get(r.request_id, r.request_id) for r in self._pending[0]}
        taken = {parent: why for parent, why in self._failures.items() if parent not in waiting}
        for parent in taken:
            del self._failures[parent]
        return taken

    def _pool(self, pooled: dict[str, torch.Tensor]) -> dict[str, list[float]]:
        """Embedding requests whose prompt is computed: their vectors, and they end here."""
        embeddings = {}
        for request_id, hidden in pooled.items():
            request = self.scheduler.requests.get(request_id)
            if request is None or request.pooling_params is None:
                continue  # aborted while the step ran
            # a classifier's logits are never normalized: LLM.classify and /classify take their softmax
            normalize = request.pooling_params.normalize and not self.model_config.labels
            hidden = hidden[: request.pooling_params.dimensions]  # (None: all of it)
            vector = torch.nn.functional.normalize(hidden, dim=-1) if normalize else hidden
            embeddings[request_id] = vector.tolist()
        self.scheduler.finish_requests(embeddings, RequestStatus.FINISHED_STOPPED)
        return embeddings

    def scheduler_request(self, request_id: str) -> Request:
        return self.scheduler.requests.get(request_id) or self.scheduler.finished[request_id]

    def _update(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """The scheduler takes the sampled tokens; the requests that got some."""
        requests, finished = self.scheduler.requests, self.scheduler.finished
        one_each = set(map(len, sampled.values())) == {1}  # (a token a request, the common step: each keeps it)
        before = 0 if one_each else sum(requests[rid].num_output_tokens for rid in sampled)
        self.scheduler.update_from_output(sched, sampled)
        updated = [requests.get(rid) or finished[rid] for rid in sampled]
        self.num_generated_tokens += len(sampled) if one_each else sum(r.num_output_tokens for r in updated) - before
        return updated

    def _sample(
        self, sched: SchedulerOutput, row_ids: list[str], logits: torch.Tensor
    ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]], dict[str, str]]:
        """The tokens each sampling request keeps this step (and their logprobs). A request
        with guesses has a row per guess and one more; row j is sampled as if the guesses
        before it were output already, and guesses are kept while each equals the token
        sampled in the row before it. Also the requests a logits processor failed on, and why."""
        if self.config.async_scheduling:  # (the step before's outputs ended some: their stop strings)
            row_ids, logits = self._live_rows(row_ids, logits)
        if not row_ids:
            return {}, {}, {}
        # (only the requests with guesses: the others have one row each)
        drafts = {s.request_id: s.token_ids[len(s.token_ids) - s.num_drafts :] for s in sched.scheduled if s.num_drafts}
        requests = [self.scheduler.requests[rid] for rid in row_ids]
        row_outputs = _row_outputs(row_ids, requests, drafts)
        masks = self.guided.masks([(rid, out, len(out) - request.num_output_tokens)  # (its guesses)
                                   for rid, out, request in zip(row_ids, row_outputs, requests, strict=True)]) \
            if self.guided.states else None
        reused = self._reused_batch(requests, masks)
        # (a reused batch reads no prompt)
        prompts = [r.prompt_tokens_seen for r in requests] if reused is None or self.logits_processors.by_request else []
        model_logits = logits.clone() if self.sampler.reports_raw and self.logits_processors.by_request else None
        failed = self.logits_processors.apply(logits, row_ids, prompts, row_outputs) if self.logits_processors.by_request else {}
        batch = reused or SamplingBatch.build(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=prompts,
            output_token_ids=row_outputs,
            generators=[self.generators.get(r.request_id) for r in requests] if self.generators else [None] * len(requests),
            eos_token_ids=sorted(self.eos_token_ids),
            vocab_size=logits.shape[-1],
            device=logits.device,
            token_masks=masks,
            banned_token_ids=_bad_word_bans(requests, row_outputs),
            forced_token_ids=self.thinking.forced(row_ids, requests, row_outputs),
        )
        if reused is None:
            self._keep_batch(requests, batch, masks)
        sampled, logprobs = _keep_matching(row_ids, self.sampler(logits, batch, model_logits), drafts)
        self.speculator.record(drafts, sampled)
        return sampled, logprobs, failed

    def _reused_batch(self, requests: list[Request], masks: torch.Tensor | None) -> SamplingBatch | None:
        """The step before's sampling batch, where it is this step's: the same requests in the
        same rows, kept only where none of them reads its output but through its grammar
        (_keep_batch), with this step's masks. None: build it."""
        if self._static_batch is None:
            return None
        kept_for, batch, masked = self._static_batch
        if kept_for != requests or masked != (masks is not None):  # (Request compares by identity)
            return None
        return batch if masks is None else batch.with_masks(masks)

    def _keep_batch(self, requests: list[Request], batch: SamplingBatch, masks: torch.Tensor | None) -> None:
        """Keep a batch the next step may reuse: one that does not change as the outputs grow
        but for its guided rows' masks, which come anew each step (no penalty counts, no
        min_tokens block, no bad words, no thinking row's forced end, no allowed_token_ids
        beside masks: they share one tensor). A decode step's rows are most often the step
        before's, and a batch walks its rows a dozen times to be built."""
        static = (batch.seen_mask is None and batch.output_counts is None and batch.blocked_rows is None
                  and not self.thinking.states and not any(r.bad_words_token_ids for r in requests)
                  and (masks is None or not any(r.sampling_params.allowed_token_ids for r in requests)))
        self._static_batch = (requests, batch, masks is not None) if static else None

    def _live_rows(self, row_ids: list[str], logits: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """The rows of the requests that still run, and their logits (a request a stop string
        ended while its last step ran computed a token it does not keep)."""
        requests = self.scheduler.requests
        if all(rid in requests for rid in row_ids):
            return row_ids, logits
        keep = [i for i, rid in enumerate(row_ids) if rid in requests]
        return [row_ids[i] for i in keep], logits[keep]

    def _record_prompt_logprobs(self, sched, chunk_logits: dict[str, torch.Tensor]) -> None:
        """Logprob of each prompt token given the tokens before it (raw model distribution),
        with the top alternatives; position 0 has none."""
        if not chunk_logits:  # (no request asked: most steps, not a walk of the batch)
            return
        for s in sched.scheduled:
            logits = chunk_logits.get(s.request_id)
            request = self.scheduler.requests.get(s.request_id)
            if logits is None or request is None:
                continue
            num_prompt = request.num_prompt_tokens
            targets = request.prompt_token_ids[s.start_pos + 1 : s.start_pos + 1 + len(s.token_ids)]
            entries = self.output_processor.prompt_logprobs_of(s.request_id, num_prompt)
            first = s.start_pos + 1
            # The first computation of a position is the one reported: an n > 1 sibling
            # recomputing the prompt's tail, or a request recomputed after preemption, leaves it.
            if all(entries[first + i] is not None for i in range(len(targets))):
                continue
            logprobs = logits[: len(targets)].log_softmax(dim=-1)  # [num_targets, vocab]
            k = request.sampling_params.prompt_logprobs or 0
            target_ids = torch.tensor(targets, dtype=torch.long)
            chosen = logprobs.gather(1, target_ids[:, None])  # [num_targets, 1]
            ranks = (logprobs > chosen).sum(-1) + 1
            top_values, top_ids = logprobs.topk(k, dim=-1)  # k may be 0: empty columns
            for i, token_id in enumerate(targets):
                if entries[first + i] is not None:
                    continue
                entries[first + i] = TokenLogprobs(
                    token_id, float(chosen[i]), int(ranks[i]),
                    dict(zip(top_ids[i].tolist(), top_values[i].tolist(), strict=True)),
                )

    def _take_aborted(self) -> list[Request]:
        aborted, self._aborted = self._aborted, []
        return aborted

    def _token_timestamps(self, r: Request, finish_reason: str | None) -> list[float] | None:
        """A Whisper request's token timestamps, where it asked for them (extra_args
        token_timestamps) and ended by its end token, a stop string or its length this step:
        where in the audio each of its tokens was said (worker.model_executor.models.whisper.token_timestamps),
        found before its audio's slot is given back."""
        if (finish_reason not in ("stop", "length") or not r.output_token_ids
                or not (r.sampling_params.extra_args or {}).get("token_timestamps")):
            return None
        weights, frames = self.runner.cross_attention_weights(
            r.request_id, [*r.prompt_token_ids, *r.output_token_ids[:-1]], self.alignment_heads)
        return token_timestamps(weights, len(r.prompt_token_ids), frames, self.median_filter_width)

    def _forget(self, finished: list[Request]) -> None:
        for request in finished:
            self.generators.pop(request.request_id, None)
            self.runner.forget(request.request_id)
            if self.runner.states is not None:
                self.runner.states.remove(request.request_id)
            self.speculator.remove(request.request_id)
            self.guided.remove(request.request_id)
            self.thinking.remove(request.request_id)
            self.logits_processors.remove(request.request_id)
            self.scheduler.finished.pop(request.request_id, None)

def _bad_word_bans(requests: list[Request], row_outputs: list[list[int]]) -> list[list[int]] | None:
    """Per row, the tokens that would complete one of its request's bad words: a sequence's
    last token, when the row's output ends with the rest of it (always, for one token)."""
    if not any(r.bad_words_token_ids for r in requests):
        return None
    return [
        [seq[-1] for seq in request.bad_words_token_ids
         if len(seq) == 1 or (len(output) >= len(seq) - 1 and output[len(output) - len(seq) + 1:] == seq[:-1])]
        for request, output in zip(requests, row_outputs, strict=True)
    ]


def _row_outputs(row_ids: list[str], requests: list[Request], drafts: dict[str, list[int]]) -> list[list[int]]:
    """Each logits row's output so far: a request's own, then one guess more per row."""
    if not drafts:  # no guesses: a row per request
        return [request.output_token_ids for request in requests]
    outputs, j = [], 0
    for i, (rid, request) in enumerate(zip(row_ids, requests, strict=True)):
        j = j + 1 if i and row_ids[i - 1] == rid else 0
        outputs.append(request.output_token_ids + drafts[rid][:j] if j else request.output_token_ids)
    return outputs


def _keep_matching(
    row_ids: list[str], out: SamplerOutput, drafts: dict[str, list[int]]
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
    """Per request, its first row's token, then each next row's while the token before it
    equals the guess that row assumed (and the logprobs of the tokens kept)."""
    if not drafts:  # no guesses: a row per request, its token kept
        sampled = {rid: [token_id] for rid, token_id in zip(row_ids, out.token_ids, strict=True)}
        if not out.logprobs:
            return sampled, {}
        return sampled, {rid: [entry] for rid, entry in zip(row_ids, out.logprobs, strict=True) if entry is not None}
    sampled = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    for i, (rid, token_id) in enumerate(zip(row_ids, out.token_ids, strict=True)):
        kept = sampled.setdefault(rid, [])
        guesses = drafts.get(rid, [])
        if kept and (len(kept) > len(guesses) or kept[-1] != guesses[len(kept) - 1]):
            continue  # a guess before this row was wrong: the row saw a wrong past
        kept.append(token_id)
        entry = out.logprobs[i] if out.logprobs else None
        if entry is not None:
            logprobs.setdefault(rid, []).append(entry)
    return sampled, logprobs


def encoder_decoder_class(config: EngineConfig, hf_config: Any, takes_audio: bool) -> type | None:
    """The model class of an encoder-decoder checkpoint (Whisper), None for any other; ValueError
    naming what it cannot run with (it runs on one device, with its checkpoint's weights as
    they are, through eager steps)."""
    if architecture_of(hf_config) != "WhisperForConditionalGeneration":
        return None
    if not takes_audio:
        raise ValueError("a Whisper checkpoint needs its preprocessor_config.json (the feature extractor)")
    refused = [name for name, on in (
        ("tensor_parallel_size > 1", config.tensor_parallel_size > 1), ("speculative_config", config.speculative_config),
        ("enable_lora", config.enable_lora), ("quantization", config.quantization),
        ("kv_cache_dtype fp8", config.kv_cache_dtype not in (None, "auto"))) if on]
    if refused:
        raise ValueError(f"Whisper runs without {', '.join(refused)}")
    from worker.model_executor.models.whisper import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration


def _max_model_len(config: EngineConfig, hf_config) -> int:
    limit = hf_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {limit}")
    return config.max_model_len


def _tokenizer_eos(tokenizer) -> set[int]:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
