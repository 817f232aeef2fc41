"""The offline API: `LLM(model).generate(prompts, sampling_params)`, as in vLLM."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from tqdm.auto import tqdm

from producer.beam_search import Beam, BeamSearchParams, best, step
from producer.pooling_params import PoolingParams
from producer.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.core.engine import Engine
from worker.core.input_processor import PromptInput, cache_salt_of
from worker.core.lora_request import LoRARequest
from worker.core.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)

T = TypeVar("T")


class RequestsFailed(RuntimeError):
    """Prompts a step failed on (a logits processor raised, the encoder failed on an image)
    after they were queued: each ended early, the others ran to their end. `outputs` holds
    every prompt's output, in input order (the failed ones with what they had, finish_reason
    "abort"); `failures` maps a failed prompt's index to why."""

    def __init__(self, outputs: list[Any], failures: dict[int, str]):
        self.outputs, self.failures = outputs, failures
        listed = "; ".join(f"prompt {i}: {why}" for i, why in failures.items())
        super().__init__(f"{len(failures)} of {len(outputs)} prompts failed as they ran ({listed}); "
                         "the exception's outputs holds every prompt's output")


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_args: Any):
        self.engine = Engine(EngineConfig.from_kwargs(model=model, dtype=dtype, **engine_args))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> None:
        """vLLM's: the next prompts compute their prefixes afresh (Engine.reset_prefix_cache)."""
        self.engine.reset_prefix_cache()

    def reload_weights(self, model_path: str | Path | None = None,
                       weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> Path | None:
        """Generate from the weights of another checkpoint of the same model (a training step's,
        a fine-tune's) from now on, or of the served checkpoint read again (None), or from
        `weights` given by their checkpoint names (a colocated trainer's
        `model.named_parameters()`), without starting over: Engine.reload_weights. Returns the
        checkpoint's directory (None for `weights`)."""
        return self.engine.weights.reload(model_path, weights)

    def sleep(self, level: int = 1) -> None:
        """vLLM's: give the device's memory back to a trainer that shares it (Engine.sleep)."""
        self.engine.weights.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: take it back, the weights and the KV cache, or those `tags` name (Engine.wake_up)."""
        self.engine.weights.wake_up(tags)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what `generate` samples with when given no params: the model's
        generation_config.json values (generation_config="auto"), vLLM's defaults otherwise."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: PromptInput | list[PromptInput],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. `lora_request` runs
        them with an adapter (one for all, or one per prompt; None: the base model).

        Every prompt is checked before any is queued, so a bad one raises ValueError (naming
        its index and what was wrong) and leaves the engine untouched."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params or self.get_default_sampling_params(), len(prompt_list))
        loras = _as_per_prompt(lora_request, len(prompt_list), "lora requests")
        checked = [self._checked(i, prompt, p, lora) for i, (prompt, p, lora) in
                   enumerate(zip(prompt_list, params, loras, strict=True))]
        ids = []
        for i, (prompt, p, lora) in enumerate(zip(checked, params, loras, strict=True)):
            request_id = str(next(self._counter))
            self.engine.add_request(request_id, prompt, p, priority=priority[i] if priority else 0,
                                    lora_request=lora)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptInput | list[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (see PoolingParams), in input order, as vLLM's `LLM.embed`.
        Every prompt is checked before any is queued, as in `generate`."""
        prompt_list = _as_prompt_list(prompts)
        loras = _as_per_prompt(lora_request, len(prompt_list), "lora requests")
        pooling_params = pooling_params or PoolingParams()
        checked = [self._checked(i, prompt, SamplingParams(), lora, pooling_params) for i, (prompt, lora) in
                   enumerate(zip(prompt_list, loras, strict=True))]
        ids = []
        for prompt, lora in zip(checked, loras, strict=True):
            ids.append(str(next(self._counter)))
            self.engine.add_request(ids[-1], prompt, lora_request=lora, pooling_params=pooling_params)
        return [EmbeddingRequestOutput(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.embedding or []))
                for out in self._run(ids, use_tqdm)]

    def classify(
        self, prompts: PromptInput | list[PromptInput], use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities, as vLLM's `LLM.classify`: the softmax of a
        classification model's score head over the prompt's last token (labels in
        `label_names`)."""
        if not self.engine.model_config.labels:
            raise ValueError(f"this model ({self.engine.model_config.architecture}) has no classification head")
        outputs = self.embed(prompts, PoolingParams(normalize=False), use_tqdm, lora_request)
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids, ClassificationOutput(
            torch.tensor(o.outputs.embedding).softmax(dim=-1).tolist())) for o in outputs]

    @property
    def label_names(self) -> tuple[str, ...]:
        """A classification model's labels, in the order of its probabilities."""
        return self.engine.model_config.labels

    def _checked(self, i: int, prompt: PromptInput, params: SamplingParams, lora: LoRARequest | None,
                 pooling_params: PoolingParams | None = None) -> dict[str, Any]:
        """The prompt tokenized once (and truncated, for an embedding that asks), its params
        and adapter checked; ValueError naming prompt i."""
        try:
            text, token_ids, images, embeds = self.engine.inputs.check_prompt(prompt, params, pooling_params)
            salt = {"cache_salt": s} if (s := cache_salt_of(prompt)) is not None else {}
            self.engine.inputs.check_params(params)
            if lora is not None:
                self.engine.add_lora(lora)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        if embeds is not None:
            return {"prompt_embeds": embeds, **salt}
        return {"prompt": text, "prompt_token_ids": token_ids, "image_inputs": images, **salt}

    def beam_search(
        self, prompts: PromptInput | list[PromptInput], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: for each prompt its `beam_width` best beams, best first.
        Each step runs every live beam of every prompt as a one-token greedy request with
        its top 2 x width logprobs (the prefix cache keeps the prompts computed), and
        producer.beam_search keeps the best."""
        checked = [self.engine.inputs.check_prompt(p) for p in _as_prompt_list(prompts)]
        if any(c.images is not None or c.embeds is not None for c in checked):
            raise ValueError("beam search over prompts with images or prompt_embeds is not supported")
        prompt_ids = [c.token_ids for c in checked]
        width = params.beam_width
        step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
        eos = set() if params.ignore_eos else set(self.engine.eos_token_ids)
        searches = [([Beam()], list[Beam]()) for _ in prompt_ids]
        for n in range(params.max_tokens):
            # prompts with live beams that still fit max_model_len (one cut there stops)
            active = [i for i, (live, _) in enumerate(searches)
                      if live and len(prompt_ids[i]) + n < self.engine.max_model_len]
            if not active:
                break
            requests: list[PromptInput] = [{"prompt_token_ids": prompt_ids[i] + beam.tokens}
                                           for i in active for beam in searches[i][0]]
            outs = self.generate(requests, step_params, use_tqdm=False)
            tops = iter([sorted((o.outputs[0].logprobs or [])[0].top_logprobs.items(), key=lambda t: -t[1])
                         for o in outs])
            for i in active:
                live, done = searches[i]
                nxt, finished = step(live, [next(tops) for _ in live], width, eos)
                searches[i] = (nxt, done + finished)
        tokenizer = self.engine.tokenizer
        return [
            BeamSearchOutput([BeamSearchSequence(b.tokens, str(tokenizer.decode(b.tokens, skip_special_tokens=True)),
                                                 b.logprob, b.finish_reason)
                              for b in best(done, live, width, params.length_penalty)])
            for live, done in searches
        ]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them (with the
        tool definitions and template variables, if any), then generate. As in vLLM,
        `continue_final_message` continues the last (assistant) message instead of beginning
        a new one, and a message's content parts may carry images (`image_url` with a data
        URL, `image_pil`) for a model that takes them."""
        conversations = cast(
            "list[list[dict[str, str]]]",
            [messages] if messages and isinstance(messages[0], dict) else messages,
        )
        add = add_generation_prompt and not continue_final_message
        prompts: list[PromptInput] = [
            self.engine.inputs.apply_chat_template(
                c, add, tools, continue_final_message, **(chat_template_kwargs or {})
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, num_tokens = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                num_tokens += sum(len(c.token_ids) for c in delta.outputs)
                _accumulate(results, delta)
                if delta.finished:
                    bar.update(1)
            elapsed = time.perf_counter() - start
            bar.set_postfix_str(f"output {num_tokens / max(elapsed, 1e-9):.1f} toks/s", refresh=False)
        bar.close()
        outputs = [results[rid] for rid in request_ids]
        failures = self.engine.take_failures()  # (the others' are older: nobody asks for them)
        if failed := {i: failures[rid] for i, rid in enumerate(request_ids) if rid in failures}:
            raise RequestsFailed(outputs, failed)
        return outputs


def _accumulate(results: dict[str, RequestOutput], delta: RequestOutput) -> None:
    current = results.get(delta.request_id)
    if current is None:
        current = results[delta.request_id] = RequestOutput(
            delta.request_id, delta.prompt, delta.prompt_token_ids, [], num_cached_tokens=delta.num_cached_tokens,
            num_prompt_tokens=delta.num_prompt_tokens,
        )
    current.num_cached_tokens = max(current.num_cached_tokens, delta.num_cached_tokens)
    if delta.prompt_logprobs is not None:
        current.prompt_logprobs = delta.prompt_logprobs
    if delta.embedding is not None:
        current.embedding = delta.embedding
    by_index = {c.index: c for c in current.outputs}
    for c in delta.outputs:
        acc = by_index.get(c.index)
        if acc is None:
            acc = by_index[c.index] = CompletionOutput(c.index, "", [], logprobs=[] if c.logprobs is not None else None)
        acc.text += c.text
        acc.token_ids += c.token_ids
        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
        if c.logprobs is not None and acc.logprobs is not None:
            acc.logprobs += c.logprobs
        if c.token_timestamps is not None:  # (the final delta's: every token's)
            acc.token_timestamps = c.token_timestamps
    current.outputs = [by_index[i] for i in sorted(by_index)]
    current.finished = delta.finished


def _as_prompt_list(prompts: PromptInput | list[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [cast("list[int]", prompts)]  # one prompt of token ids
    return list(cast("list[PromptInput]", prompts))


def _as_params_list(params: SamplingParams | list[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    return _as_per_prompt(params, n, "sampling params")


def _as_per_prompt(value: T | list[T], n: int, what: str) -> list[T]:
    """One value for every prompt, or a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"got {len(value)} {what} for {n} prompts")
    return list(value)
