"""Sampling parameters: part of the wire protocol, so they live in `producer`.

Field names and meanings follow vLLM's `SamplingParams`; every check raises `ValueError`
naming the field and its allowed range, so a bad job fails with a message its sender can act on.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from producer.field_mappings import from_mapping
from producer.grammar.json_schema import check_enforceable
from producer.grammar.structural_tag import read_structural_tag

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
GUIDED_KINDS = {"json_object", "json_schema", "choice", "regex", "grammar", "structural_tag"}
# Below this, temperature is greedy: dividing logits by a tinier number overflows to inf.
MIN_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs (`SamplingParams(structured_outputs=...)`, the API's
    `structured_outputs`): exactly one of `json` (a JSON schema, or its text), `regex`,
    `choice`, `grammar` (xgrammar's EBNF, or a Lark grammar), `json_object` or `structural_tag` (its JSON
    text or mapping, `producer.grammar.structural_tag`). `disable_any_whitespace` writes JSON compact
    (one space after each `,` and `:`, none elsewhere, as xgrammar does). The options vLLM hands
    its backends are taken where genq already does what they ask: `disable_additional_properties`
    (objects with properties are closed) and `disable_fallback` (there is one backend)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | dict[str, Any] | None = None

    def guided_decoding(self) -> dict[str, Any]:
        """The same request as `SamplingParams.guided_decoding` spells it."""
        if self.whitespace_pattern:
            raise ValueError("structured_outputs whitespace_pattern is not supported")
        given = {
            "json_schema": _schema_object(self.json), "regex": self.regex, "choice": self.choice,
            "grammar": self.grammar, "json_object": self.json_object or None,
            "structural_tag": None if self.structural_tag is None else read_structural_tag(self.structural_tag),
        }
        given = {k: v for k, v in given.items() if v is not None}
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must give exactly one of json, regex, choice, grammar, json_object or structural_tag, "
                f"got {sorted(given) or 'none'}".replace("json_schema", "json")
            )
        if self.disable_any_whitespace and given.keys() & {"json_schema", "json_object"}:
            given["disable_any_whitespace"] = True  # (JSON's only: other grammars say their spaces)
        return given

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutputsParams:
        return data if isinstance(data, cls) else from_mapping(cls, data, "structured_outputs", "structured_outputs field(s)")


def _schema_object(schema: Any) -> Any:
    """A schema given as JSON text (vLLM takes either), parsed."""
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except ValueError:
        raise ValueError("structured_outputs json must be a JSON schema or its JSON text") from None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    # A prompt plus max_tokens past max_model_len is refused (vLLM's rule); with this, max_tokens
    # is cut to the room the prompt leaves instead (genq's: Anthropic's Messages API stops at the
    # context window, and a model's default max_tokens is cut so)
    clamp_max_tokens: bool = False
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-k alternatives per generated token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # vLLM's guided decoding, one of: {"json_object": True} (the output is one JSON object),
    # {"json_schema": schema} (a value of that schema), {"choice": [strings]} (the output is one
    # of them), {"regex": pattern} (the output matches it whole), {"grammar": ebnf} (the output
    # is a sentence of it: xgrammar's EBNF, or a Lark grammar, one without "::="),
    # {"structural_tag": ...} (producer.grammar.structural_tag). The worker compiles them with
    # xgrammar and fails a job whose guide it cannot read, naming what is wrong; here their
    # shapes are checked, and the JSON Schema keywords xgrammar would not hold the output to
    # refused (producer.grammar.json_schema): the API never imports xgrammar, which imports torch.
    # JSON with "disable_any_whitespace": True is
    # compact (one space after each , and :); with "after": text, the
    # output is free until that text (a reasoning model's "</think>") and guided after it
    guided_decoding: dict[str, Any] | None = None
    # vLLM's current spelling of the same (StructuredOutputsParams, or its fields as a
    # mapping): read into guided_decoding when the params are made, then None
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    # vLLM's: keep only the last k tokens of a longer prompt (-1: as many as max_model_len
    # leaves room for, with max_tokens, or one token, to generate); None: a prompt too long is refused
    truncate_prompt_tokens: int | None = None
    # vLLM's: words the output may not contain. Each is tokenized as written and after a
    # space; the last token of a tokenization is banned whenever the output ends with the rest
    bad_words: list[str] | None = None
    # vLLM's: settings for the worker's custom logits processors (worker.sample.logits_processors),
    # a JSON object each reads its own keys from; the API takes it as `vllm_xargs`
    extra_args: dict[str, Any] | None = None
    # OpenAI's predicted output: text the output is expected to largely repeat (a file being
    # edited). A worker that guesses with n-grams (speculative_config method "ngram") guesses
    # from it too; the output is the same with it or without it, only sooner
    prediction: str | None = None
    # vLLM's: a reasoning model writes at most this many tokens of thinking, then the end of
    # its thinking (`</think>`) is forced and it answers (worker.sample.thinking_budget); None: no limit
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = _token_keys(self.logit_bias)
        if self.top_k == 0:
            self.top_k = -1
        if self.structured_outputs is not None:
            if self.guided_decoding is not None:
                raise ValueError("structured_outputs and guided_decoding ask for the same thing: give one")
            guided = StructuredOutputsParams.from_dict(self.structured_outputs).guided_decoding()
            try:
                _check_guided(guided)
            except ValueError as exc:  # named as it was given
                raise ValueError(str(exc).replace("guided_decoding", "structured_outputs", 1)) from None
            self.guided_decoding, self.structured_outputs = guided, None
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_number("temperature", self.temperature, "must be finite and >= 0", lambda v: 0 <= v < math.inf)
        _check_number("top_p", self.top_p, "must be in (0, 1]", lambda v: 0 < v <= 1)
        _check_int("top_k", self.top_k, low=-1, note="-1 or 0 disables it")
        _check_number("min_p", self.min_p, "must be in [0, 1]", lambda v: 0 <= v <= 1)
        if self.seed is not None:
            _check_int("seed", self.seed, low=SEED_RANGE[0], high=SEED_RANGE[1])
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), "must be in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_number(
            "repetition_penalty", self.repetition_penalty, "must be finite and > 0", lambda v: 0 < v < math.inf
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, low=0, high=MAX_LOGPROBS)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.bad_words is not None and not (
            isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        self._validate_token_lists()
        k = self.truncate_prompt_tokens
        if k is not None and k != -1:
            _check_int("truncate_prompt_tokens", k, low=1, note="-1 keeps as many as max_model_len allows")
        self._validate_extras()

    def _validate_extras(self) -> None:
        """Guided decoding, the predicted output and the logits processors' settings."""
        if self.guided_decoding is not None:
            _check_guided(self.guided_decoding)
        if self.prediction is not None and (not isinstance(self.prediction, str) or not self.prediction):
            raise ValueError(f"prediction must be a non-empty string, got {self.prediction!r}")
        if self.extra_args is not None and not (
            isinstance(self.extra_args, dict) and all(isinstance(k, str) for k in self.extra_args) and _is_json(self.extra_args)
        ):
            raise ValueError(f"extra_args must be a JSON object, got {self.extra_args!r}")
        if not isinstance(self.clamp_max_tokens, bool):
            raise ValueError(f"clamp_max_tokens must be true or false, got {self.clamp_max_tokens!r}")

    def _validate_token_lists(self) -> None:
        for token_id, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias", token_id, low=0, note="keys are token ids")
            _check_number(
                "logit_bias", bias, f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                lambda v: -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS,
            )
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}"
                )
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id, low=0)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["structured_outputs"]  # always None: read into guided_decoding
        for optional in ("extra_args", "prediction", "clamp_max_tokens"):
            if not data[optional]:  # unset, a job reads as it did before them
                del data[optional]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a decoded payload; unknown fields are an error, not silently dropped."""
        return from_mapping(cls, data, "sampling_params", "sampling parameter(s)")


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _check_guided(guided: Any) -> None:
    kinds = set(guided) - {"after", "disable_any_whitespace"} if isinstance(guided, dict) else set()
    if len(kinds) != 1 or not kinds <= GUIDED_KINDS:
        raise ValueError(
            'guided_decoding must be {"json_object": true}, {"json_schema": {...}}, '
            f'{{"choice": [strings]}}, {{"regex": pattern}}, {{"grammar": ebnf}} or '
            f'{{"structural_tag": {{"structures", "triggers"}}}} (and optionally "after": text), got {guided!r}'
        )
    after = guided.get("after")
    if after is not None and (not isinstance(after, str) or not after):
        raise ValueError(f"guided_decoding after must be a non-empty string, got {after!r}")
    if not isinstance(guided.get("disable_any_whitespace", False), bool):
        raise ValueError("guided_decoding disable_any_whitespace must be true or false")
    if "json_schema" in guided:
        schema = guided["json_schema"]
        if not isinstance(schema, dict | bool) or not _is_json(schema):
            raise ValueError(f"guided_decoding json_schema must be a JSON schema (an object), got {schema!r}")
        try:
            check_enforceable(schema)
        except ValueError as exc:
            raise ValueError(f"guided_decoding json_schema: {exc}") from None
        return
    for kind in ("regex", "grammar"):
        if kind in guided and (not isinstance(guided[kind], str) or not guided[kind].strip()):
            raise ValueError(f"guided_decoding {kind} must be a non-empty string, got {guided[kind]!r}")
    if "structural_tag" in guided:
        try:
            read_structural_tag(guided["structural_tag"])
        except ValueError as exc:
            raise ValueError(f"guided_decoding {exc}") from None
        return
    if "json_object" in guided and guided["json_object"] is not True:
        raise ValueError(f"guided_decoding json_object must be true, got {guided['json_object']!r}")
    choices = guided.get("choice", ["x"])
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"guided_decoding choice must be a non-empty list of non-empty strings, got {choices!r}")


def _token_keys(mapping: Any) -> dict[int, float]:
    """logit_bias with int keys: JSON has only string keys, so "50256" is taken as 50256."""
    if not isinstance(mapping, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {mapping!r}")
    out = {}
    for key, value in mapping.items():
        if isinstance(key, str):
            try:
                key = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        out[key] = value
    return out


def _check_int(
    name: str, value: Any, low: int | None = None, high: int | None = None, note: str = ""
) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}{' (' + note + ')' if note else ''}, got {value}")


def _check_number(name: str, value: Any, rule: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or not ok(value):
        raise ValueError(f"{name} {rule}, got {value}")
