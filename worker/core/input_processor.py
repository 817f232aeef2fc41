"""Input processing (vLLM's InputProcessor): what a request brings, checked and made into
what the scheduler runs, before anything of it reaches the engine.

A prompt (text, token ids, a dict with images or audio, or embeddings) becomes token ids,
processed images and embeddings, each refused by name where it does not fit the model
(ValueError); sampling parameters are checked against the model's vocabulary; a chat becomes
a prompt through the model's template. Also the module-level rules the API and the offline
`LLM` share with the engine: a prompt and max_tokens must fit max_model_len, a cache salt,
a chat template read from a file or given whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from producer.chat_template import render_chat
from producer.pooling_params import PoolingParams
from producer.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.core.multimodal import ImageInputs, PreparedImages, chat_media, images_of
from worker.core.prompt_embeds import PLACEHOLDER_ID, checked_embeds, prompt_embeds_of
from worker.model_executor.models.config import ModelConfig

PromptInput = str | list[int] | dict[str, Any]


class CheckedPrompt(NamedTuple):
    text: str | None
    token_ids: list[int]
    images: ImageInputs | None = None  # its images processed, their tokens in token_ids
    embeds: torch.Tensor | None = None  # given as embeddings: [len(token_ids), hidden], the ids placeholders


class InputProcessor:
    """The checks and conversions of a request's inputs for one model. `image_processor` is
    the model's (None: it takes no images or audio); `alignment_heads` its token timestamps'
    cross-attention heads (Whisper's, when `whisper`)."""

    def __init__(self, config: EngineConfig, tokenizer: Any, model_config: ModelConfig, max_model_len: int,
                 image_processor: Any, alignment_heads: list[tuple[int, int]], whisper: bool) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.image_processor = image_processor
        self.alignment_heads = alignment_heads
        self.whisper = whisper

    def check_prompt(
        self, prompt: PromptInput, params: SamplingParams | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> CheckedPrompt:
        """The prompt's text (if any), token ids and images; ValueError naming what is wrong
        with it. An embedding request's prompt may fill max_model_len (nothing follows it);
        with `truncate_prompt_tokens` (of the pooling params, else of the sampling params) a
        prompt keeps only its last tokens. A prompt dict's `multi_modal_data` images are
        processed here, each image token in the prompt widened to the image's tokens
        (worker.core.multimodal); a dict LLM made of one checked (`image_inputs`) passes as it is."""
        if (embeds := prompt_embeds_of(prompt)) is not None:
            return self._check_embeds(embeds, params, pooling_params)
        text, prompt_ids = self._tokenize(prompt)
        images = prompt.get("image_inputs") if isinstance(prompt, dict) else None
        if self.image_processor is None and isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise ValueError(f"this model ({self.model_config.architecture}) takes no images or audio")
        modality = "image" if self.image_processor is None else self.image_processor.modality
        if images is None and (given := images_of(prompt, modality)):
            assert self.image_processor is not None
            self.check_image_count(len(given.digests) if isinstance(given, PreparedImages) else len(given))
            if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(text, str):
                prompt_ids = (self.tokenizer.encode(text, add_special_tokens=False)  # (a decoder prompt: as written)
                              if self.image_processor.encoder_decoder
                              else self._expanded_ids(text, prompt_ids, with_specials=True))
            prompt_ids, images = self.image_processor.process(prompt_ids, given)
            if self.image_processor.both_ways:  # each image is computed in one step
                longest = max(hi - lo for lo, hi in images.embed_ranges())
                if longest > self.config.max_num_batched_tokens:
                    raise ValueError(f"an image takes {longest} tokens, computed in one step, but "
                                     f"max_num_batched_tokens is {self.config.max_num_batched_tokens}")
        if images is None and self.image_processor is not None and self.image_processor.encoder_decoder:
            raise ValueError(f"this model ({self.model_config.architecture}) reads an audio clip with its prompt: "
                             "give one as multi_modal_data {'audio': clip}")
        limit, keep = self._prompt_limits(params, pooling_params)
        if keep is not None:
            if images is not None:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
            prompt_ids = prompt_ids[-keep:]
        self._validate_prompt(prompt_ids, limit)
        return CheckedPrompt(text, prompt_ids, images)

    def _prompt_limits(self, params: SamplingParams | None, pooling_params: PoolingParams | None) -> tuple[int, int | None]:
        """The most tokens a prompt may have (a generation must leave room for a token; an
        embedding's prompt may fill max_model_len), and how many of its last ones
        truncate_prompt_tokens keeps (of the pooling params, else of the sampling params;
        None: all; -1: as many as leave room for max_tokens)."""
        limit = self.max_model_len if pooling_params is not None else self.max_model_len - 1
        source = pooling_params if pooling_params is not None else params
        k = source.truncate_prompt_tokens if source is not None else None
        if k == -1 and pooling_params is None and params is not None and params.max_tokens and not params.clamp_max_tokens:
            # room for the tokens asked for, so -1 never keeps a prompt that check_fits refuses
            return limit, max(self.max_model_len - params.max_tokens, 1)
        return limit, None if k is None else min(limit if k == -1 else k, limit)

    def _check_embeds(self, given: torch.Tensor | bytes, params: SamplingParams | None,
                      pooling_params: PoolingParams | None) -> CheckedPrompt:
        """A prompt given as embeddings (worker.core.prompt_embeds): checked, cut to its last
        truncate_prompt_tokens rows, with a placeholder id per row."""
        if params is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs the prompt's tokens: a prompt given as prompt_embeds has none")
        embeds = checked_embeds(given, self.model_config.hidden_size)
        limit, keep = self._prompt_limits(params, pooling_params)
        if keep is not None:
            embeds = embeds[-keep:]
        prompt_ids = [PLACEHOLDER_ID] * len(embeds)
        self._validate_prompt(prompt_ids, limit)
        return CheckedPrompt(None, prompt_ids, None, embeds)

    def check_image_count(self, count: int) -> None:
        """ValueError where one prompt holds more images than max_images_per_prompt."""
        if count > self.config.max_images_per_prompt:
            kind = "audio clips" if self.image_processor is not None and self.image_processor.modality == "audio" else "images"
            raise ValueError(f"the prompt holds {count} {kind}, more than max_images_per_prompt "
                             f"({self.config.max_images_per_prompt})")

    def _expanded_ids(self, text: str, prompt_ids: list[int], with_specials: bool) -> list[int]:
        """A text prompt's ids as the model's processor tokenizes it around its images (Gemma
        3 sets each off by blank lines, which join the text's own newlines), else
        `prompt_ids`; `with_specials`: as a plain prompt is tokenized (a chat template's text
        writes its own). Token ids a caller gives are taken as they are."""
        assert self.image_processor is not None
        expanded = self.image_processor.expand_text(text)
        if expanded == text:
            return prompt_ids
        return self.tokenizer.encode(expanded, add_special_tokens=with_specials)

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def _validate_prompt(self, prompt_ids: list[int], limit: int) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(prompt_ids) > limit:
            room = ("and at least one token must be left to generate" if limit < self.max_model_len
                    else "(truncate_prompt_tokens keeps only the last tokens)")
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens, but max_model_len is {self.max_model_len} {room}"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")

    def check_dimensions(self, dimensions: int) -> None:
        """A vector cut to its first `dimensions` values means something only where the model
        was trained so (Matryoshka: its config's is_matryoshka or matryoshka_dimensions, as vLLM
        reads them; hf_overrides can set them)."""
        hf, hidden = self.model_config.hf_config, self.model_config.hidden_size
        sizes = getattr(hf, "matryoshka_dimensions", None)
        if self.model_config.labels or not (getattr(hf, "is_matryoshka", False) or sizes):
            raise ValueError(f"dimensions: this model ({self.model_config.architecture}) does not declare Matryoshka "
                             "embeddings (is_matryoshka), so its vectors have one size")
        if dimensions > hidden or (sizes and dimensions not in sizes):
            allowed = sorted(sizes) if sizes else f"up to {hidden}"
            raise ValueError(f"dimensions must be one of this model's Matryoshka sizes ({allowed}), got {dimensions}")

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: logit_bias and allowed_token_ids may only
        name tokens this model has."""
        vocab = self.model_config.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            bad = [t for t in getattr(params, name) or () if t >= vocab]
            if bad:
                raise ValueError(f"{name} names token id {bad[0]}, outside the vocabulary [0, {vocab})")
        if (params.extra_args or {}).get("token_timestamps") and not self.alignment_heads:
            raise ValueError("extra_args token_timestamps: " + (
                "this Whisper checkpoint names no alignment_heads (generation_config.json) to find them by"
                if self.whisper else
                f"token timestamps are a Whisper model's, this one is {self.model_config.architecture}"))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool | None = None,
        tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> dict[str, Any]:
        """The prompt for a conversation (producer.chat_template.render_chat), with the
        images (or audio clips) its messages' content parts carry (worker.core.multimodal.chat_media)."""
        messages, images, modality = chat_media(messages)
        if images and self.image_processor is None:  # (before a text model's template chokes on parts)
            raise ValueError(f"this model ({self.model_config.architecture}) takes no images or audio")
        prompt = render_chat(self.tokenizer, messages, add_generation_prompt, tools, continue_final_message,
                             **template_kwargs)
        if not images:
            return prompt
        prompt["prompt_token_ids"] = self._expanded_ids(prompt["prompt"], prompt["prompt_token_ids"],
                                                        with_specials=False)
        return {**prompt, "multi_modal_data": {modality: images}}

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokenizations as written and after a space (as it reads mid-sentence),
        without repeats, as vLLM bans bad words."""
        sequences: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    sequences[ids] = None
        return [list(ids) for ids in sequences]


def read_chat_template(given: str) -> str:
    """A chat template from a file's path or given as itself; ValueError naming chat_template
    for a file that is not there or a template Jinja cannot read."""
    path = Path(given).expanduser()
    looks_like_path = "{" not in given and "\n" not in given
    if looks_like_path and not path.is_file():
        raise ValueError(f"chat_template {given!r} is no file (give a Jinja file's path, or the template itself)")
    text = path.read_text() if looks_like_path else given
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not parse as Jinja: {exc.message} (line {exc.lineno})") from None
    return text


def check_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """ValueError, in vLLM's words, where a prompt and the tokens asked for cannot both fit the
    model's context (a job never quietly gets fewer tokens than it asked for); max_tokens None
    asks for as many as fit."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            "completion). Please reduce the length of the prompt or max_tokens."
        )


def cache_salt_of(prompt: PromptInput) -> str | None:
    """A prompt dict's `cache_salt` (vLLM's: its blocks are shared only with requests of the
    same salt); ValueError unless it is a non-empty string."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt
