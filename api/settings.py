"""API configuration, read from the environment (prefix `GENQ_`) at the entry point only.

`create_app(settings)` receives a built `Settings`; nothing below reads the environment.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

from pydantic import field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from producer.jobs import DEFAULT_REDIS_URL
from producer.protocol import DEFAULT_PREFIX


class Settings(BaseSettings):
    """`GENQ_REDIS_URL`, `GENQ_API_KEYS=key1,key2`, `GENQ_MAX_QUEUED_JOBS=1000`, ..."""

    model_config = SettingsConfigDict(env_prefix="GENQ_", frozen=True, extra="ignore")

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = DEFAULT_PREFIX  # Redis key prefix, as the workers use it
    # GENQ_REDIS_SHARDS: request-stream shards on a Redis Cluster; None: the number the cluster
    # records (producer.shards); always 1 on a single Redis
    redis_shards: int | None = None
    # Empty: no authentication. Else every /v1 route needs `Authorization: Bearer <key>`.
    api_keys: Annotated[tuple[str, ...], NoDecode] = ()
    # Backpressure: submissions are refused with 429 while the queue depth (entries not yet
    # delivered + delivered but not acknowledged) is at or above this. None: no limit.
    max_queued_jobs: int | None = 1000
    retry_after_s: int = 1  # the Retry-After header of a 429, and of a 503 while Redis is away
    # Requests per minute each API key may make to the endpoints that queue work (429 past
    # it, with Retry-After to the next minute). None: no limit. Needs api_keys.
    rate_limit_rpm: int | None = None
    # Tokens (prompt and completion) per minute each API key may use: counted as its jobs end,
    # so new work is refused (429 until the next minute) once the minute's jobs reached it.
    # None: no limit. Needs api_keys.
    rate_limit_tpm: int | None = None
    # Listed by /v1/models when no live worker reports a model; the `model` of responses to
    # requests that name none.
    served_model_name: str = "genq"
    request_timeout_s: float = 600.0  # a relayed request longer than this is cancelled (504)
    # A JSON line per request on the logger genq.requests (api.request_log): path, status,
    # seconds, request id, key, and a generation's jobs, tokens, first-token time and ending;
    # never prompts or outputs.
    log_requests: bool = False
    # vLLM's VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache (api.routes.dev), for benchmarks
    server_dev_mode: bool = False
    # How chat replies are read for tool calls under tool_choice "auto": "hermes"
    # (<tool_call>{...}</tool_call>: Qwen, Hermes, SmolLM2), "llama3_json" (Llama 3.1 to 3.3),
    # "mistral" ([TOOL_CALLS]...), "granite" (<|tool_call|>[...]: Granite 3), "glm45" (<tool_call>name<arg_key>...: GLM-4.5 to 4.7),
    # "qwen3_coder" (<tool_call><function=name><parameter=...: Qwen3-Coder, Qwen3.5),
    # "pythonic" ([get_weather(city="Paris")]: Llama 3.2 and Llama 4), "deepseek_v3" (DeepSeek-V3,
    # R1), "deepseek_v31" (DeepSeek-V3.1, V3.2), "kimi_k2" (api.parsers.section_tool_calls), "seed_oss"
    # (<seed:tool_call><function=...: Seed-OSS), "minimax_m2" (<minimax:tool_call><invoke name=...:
    # MiniMax-M2), or "none" to refuse "auto" with a 400.
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "granite", "glm45", "qwen3_coder", "pythonic",
                              "deepseek_v3", "deepseek_v31", "kimi_k2", "seed_oss", "minimax_m2", "none"] = "hermes"
    # How chat replies of reasoning models are split into reasoning_content and content
    # (api.parsers.reasoning): "deepseek_r1", "qwen3", "glm45", "seed_oss", "mistral", "granite",
    # "minimax_m2" (or "minimax_m2_append_think": the thinking kept in the content), "deepseek_v3",
    # "gpt_oss" (harmony channels, api.parsers.harmony), or "none" (not a reasoning model).
    reasoning_parser: Literal["none", "deepseek_r1", "qwen3", "glm45", "seed_oss", "mistral", "granite", "minimax_m2",
                              "minimax_m2_append_think", "deepseek_v3", "gpt_oss"] = "none"
    # vLLM's --default-chat-template-kwargs: variables every chat request's template gets
    # unless the request sets them itself (e.g. {"enable_thinking": false}); JSON in the environment
    default_chat_template_kwargs: dict[str, Any] = {}
    # /v1/load_lora_adapter and /v1/unload_lora_adapter exist only when this is on (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): they make workers read paths on their disks.
    allow_runtime_lora_updating: bool = False
    # The batch API: uploads up to this size, kept this long (stored responses too); each batch keeps at most
    # batch_max_in_flight of its requests in the queue at once (the rest wait in Redis, so
    # interactive requests are not stuck behind a whole batch), checked every batch_poll_s.
    max_file_bytes: int = 100 << 20
    # A request body (JSON) larger than this is a 413 before anything is queued (api.body_limit);
    # multipart uploads keep their own limits (max_file_bytes, max_audio_bytes). It leaves room
    # for a prompt_embeds tensor of max_prompt_embeds_bytes in base64.
    max_request_bytes: int = 100 << 20
    # Chat images given as http(s) URLs are fetched by this server (api.images), up to this
    # size and time each; off, only data URLs are taken (fetching opens any URL a client names).
    fetch_image_urls: bool = True
    max_image_bytes: int = 20 << 20
    # /v1/completions' prompt_embeds: the most bytes one tensor may take (torch.save's; 64 MiB is
    # 8192 positions of a 4096-wide model in bfloat16); each travels in its job through Redis
    max_prompt_embeds_bytes: int = 64 << 20
    max_images_per_request: int = 8  # vLLM's limit_mm_per_prompt: each image is a vision-encoder run
    # /v1/audio/transcriptions and /translations run as a chat with the clip and this instruction
    # (api.transcriptions), for models that take audio; the upload may be this large
    transcription_instruction: str = "Transcribe the speech in this audio word for word, and write nothing else."
    translation_instruction: str = ("Translate the speech in this audio into English, and write the translation "
                                    "and nothing else.")
    max_audio_bytes: int = 25 << 20  # OpenAI's limit
    audio_chunk_s: float = 30.0  # a longer upload is cut into pieces this long, each its own job (Qwen2-Audio's window)
    # Whisper at temperature 0 decodes as whisper-1 (OpenAI's transcribe): a piece whose text
    # repeats itself (its zlib compression ratio over this) or whose tokens were unlikely (their
    # mean logprob under this) is decoded again at 0.2, 0.4, ... 1.0; one where <|nospeech|> was
    # likelier than this after <|startoftranscript|> is not decoded again, and is dropped as
    # silence where its tokens were that unlikely too. inf and -inf turn a check off.
    whisper_compression_ratio_threshold: float = 2.4
    whisper_logprob_threshold: float = -1.0
    whisper_no_speech_threshold: float = 0.6
    # Whisper's pieces of a long upload one after another, each prompted with the text before it
    # (openai-whisper's condition_on_previous_text: steadier names and style), not all at once
    whisper_condition_on_previous_text: bool = False
    image_fetch_timeout_s: float = 10.0
    file_ttl_s: int = 7 * 24 * 3600
    batch_max_in_flight: int = 64
    batch_poll_s: float = 0.5

    # OpenAI's webhooks: background responses and batches that end are announced by a POST of
    # {"object": "event", "type": "response.completed", "data": {"id": ...}} to this URL,
    # signed with the secret as Standard Webhooks sign (OpenAI's clients verify it:
    # client.webhooks.unwrap); retried with backoff while the receiver fails (api.webhooks)
    webhook_url: str | None = None
    webhook_secret: str | None = None  # whsec_<base64>, as OpenAI's dashboard gives one
    webhook_max_attempts: int = 8
    # a sender (an API process) not seen this long, with no event pending, leaves the group
    # (one that stopped); a live one reads every second, and reading joins it again
    webhook_sender_ttl_s: float = 60.0
    # vLLM's --otlp-traces-endpoint: a span per request to this OpenTelemetry collector (OTLP
    # over HTTP), the parent of the workers' spans of its jobs (producer.tracing)
    otlp_traces_endpoint: str | None = None
    # the per-step trace (producer.trace_log): a JSON line per event a stream writes to its
    # client, and per gc pause, into this directory (benchmarks/itl_trace.py reads it); None: off
    trace_dir: str | None = None

    # A stream that has sent nothing this long (its job waiting in the queue) sends an SSE
    # comment, so proxies that close idle connections leave it open; 0: never
    sse_keepalive_s: float = 15.0
    # Browsers may call the API from these origins (CORS; vLLM's --allowed-origins, every
    # origin by default as in vLLM: keys are bearer tokens, never cookies); empty: none
    allowed_origins: Annotated[tuple[str, ...], NoDecode] = ("*",)

    @model_validator(mode="after")
    def _webhook_signed(self) -> Settings:
        """A webhook URL needs a secret to sign with; a whsec_ secret must decode."""
        if self.webhook_url is not None and not self.webhook_secret:
            raise ValueError("GENQ_WEBHOOK_URL needs GENQ_WEBHOOK_SECRET (whsec_ and 32 random bytes in base64) "
                             "to sign its events with")
        if self.webhook_secret is not None and self.webhook_secret.startswith("whsec_"):
            try:
                base64.b64decode(self.webhook_secret[6:], validate=True)
            except binascii.Error:
                raise ValueError("GENQ_WEBHOOK_SECRET must be whsec_ followed by base64") from None
        if self.webhook_max_attempts < 1:
            raise ValueError(f"GENQ_WEBHOOK_MAX_ATTEMPTS must be at least 1, got {self.webhook_max_attempts}")
        return self

    @field_validator("api_keys", "allowed_origins", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        """Comma-separated in the environment; blanks are ignored."""
        if isinstance(value, str):
            return tuple(k.strip() for k in value.split(",") if k.strip())
        return value

    @field_validator("max_queued_jobs", "rate_limit_rpm", "rate_limit_tpm", mode="before")
    @classmethod
    def _no_limit(cls, value: object) -> object:
        """`GENQ_MAX_QUEUED_JOBS=` (empty) or `none` turns the limit off (and the same for
        GENQ_RATE_LIMIT_RPM and GENQ_RATE_LIMIT_TPM)."""
        if isinstance(value, str) and value.strip().lower() in ("", "none"):
            return None
        return value
