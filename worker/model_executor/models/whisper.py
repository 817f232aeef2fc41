"""Whisper's decoder (WhisperForConditionalGeneration), an encoder-decoder model: its
self-attention keeps KV in the paged cache as any decoder's, and its cross-attention reads the
keys and values of its request's audio, computed once from the encoder's output
(`cross_kv`, when the request's first chunk runs) and kept in a slot of CrossStates for the
request's life. The encoder is transformers' module (worker.core.multimodal.WhisperEncoder).

Layers are pre-norm with LayerNorm and biases (no bias on the key projections), the MLP is
fc1, GELU, fc2, positions are learned embeddings, and the head is the token embedding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from worker.model_executor.models.config import ModelConfig
from worker.model_executor.models.logits_buffer import LogitsBuffer

DECODER_PREFIX = "model.decoder."

# The chat template of a Whisper checkpoint (it has none of its own): a conversation's audio
# part goes to the encoder, and the decoder's prompt is written from the template's variables:
# `language` (a code: "en") and `task` ("transcribe" or "translate"), where given, and the
# `prompt` (earlier speech) after <|startofprev|>, and `timestamps` (the reply's segments between
# timestamp tokens: WhisperRules); `detect_language` writes the start alone, whose next token is
# the language the model hears (the API's transcriptions ask it for one token).
CHAT_TEMPLATE = (
    "{%- if detect_language -%}<|startoftranscript|>{%- else -%}"
    "{%- if prompt %}<|startofprev|> {{ prompt | trim }}{% endif -%}"
    "<|startoftranscript|>{% if language %}<|{{ language }}|>{% endif %}{% if task %}<|{{ task }}|>{% endif %}"
    "{% if not timestamps %}<|notimestamps|>{% endif %}{%- endif -%}"
)
# An English-only checkpoint's (generation_config's is_multilingual false: whisper-*.en): its
# prompts have no language or task token, whatever the variables say
ENGLISH_CHAT_TEMPLATE = (
    "{%- if prompt %}<|startofprev|> {{ prompt | trim }}{% endif -%}"
    "<|startoftranscript|>{% if not timestamps %}<|notimestamps|>{% endif %}"
)


class WhisperRules:
    """transformers' Whisper generation rules, as a logits processor (worker.sample.logits_processors)
    every request of a Whisper engine has: `suppress` tokens are never written (symbols and
    non-speech marks; the model's logits keep them, so a prompt's logprobs tell how likely
    <|nospeech|> was), `begin_suppress` tokens cannot come first; and, in a
    request whose prompt has no <|notimestamps|> (`no_timestamps`), the timestamp rules: the
    first token is a timestamp (at most `max_initial` steps past 0), timestamps come in pairs
    (but one before the end), never go back, and one is forced where all of them together are
    likelier than any text token. Timestamps are the ids after <|notimestamps|>. A prompt that
    ends at <|startoftranscript|> (`start`, for a multilingual model) asks for the language
    heard: no rule applies."""

    def __init__(self, no_timestamps: int | None, eos: int, begin_suppress: list[int], max_initial: int | None,
                 start: int | None = None, suppress: list[int] | None = None):
        self.no_timestamps, self.eos, self.max_initial, self.start = no_timestamps, eos, max_initial, start
        self.first = None if no_timestamps is None else no_timestamps + 1  # <|0.00|>
        self.begin_suppress = torch.tensor(begin_suppress, dtype=torch.long)
        self.suppress = torch.tensor(suppress or [], dtype=torch.long)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # both, copied to a device once

    def new_req_logits_processor(self, params) -> Callable[[list[int], list[int], torch.Tensor], torch.Tensor]:
        return self.apply

    def apply(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if prompt_ids[-1:] == [self.start]:
            return logits
        if logits.device not in self._on:
            self._on[logits.device] = (self.suppress.to(logits.device), self.begin_suppress.to(logits.device))
        suppress, begin_suppress = self._on[logits.device]
        if len(suppress):
            logits = logits.index_fill(0, suppress, float("-inf"))
        if not output_ids and len(begin_suppress):
            logits = logits.index_fill(0, begin_suppress, float("-inf"))
        if self.first is None or self.no_timestamps in prompt_ids:
            return logits
        return self._timestamps(output_ids, logits.clone())

    def _timestamps(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        first, inf = self.first, float("-inf")
        assert first is not None
        logits[self.no_timestamps] = inf
        stamps = [t for t in output_ids if t >= first]
        last_stamp = bool(output_ids) and output_ids[-1] >= first
        pair_closed = len(output_ids) < 2 or output_ids[-2] >= first  # (a pair, or the start)
        if last_stamp:
            if pair_closed:
                logits[first:] = inf  # text follows a pair
            else:
                logits[: self.eos] = inf  # a timestamp that opened a segment's end: another, or the end
        if stamps:  # never back, nor the same one again but to close a pair
            logits[first : stamps[-1] + (0 if last_stamp and not pair_closed else 1)] = inf
        if not output_ids:
            logits[:first] = inf
            if self.max_initial is not None:
                logits[first + self.max_initial + 1 :] = inf
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if logprobs[first:].logsumexp(-1) > logprobs[:first].max():
            logits[:first] = inf
        return logits


TIME_PRECISION = 0.02  # seconds between two of the encoder's positions (its 30 s over 1500)


def token_timestamps(weights: torch.Tensor, num_prompt: int, num_frames: int, median_width: int = 7) -> list[float]:
    """Where in the audio (seconds) each token of a reply was said, as transformers' Whisper
    finds it (return_token_timestamps): `weights` are the alignment heads' cross-attention
    over the prompt and every reply token but the last, as inputs ([heads, rows, positions]:
    cross_attention_weights'). The reply's rows, over the positions that hold the clip's
    `num_frames` mel frames, are normalized along the tokens, median-filtered along the
    audio, averaged over the heads, and aligned to the audio by dynamic time warping; each
    token's time is where its row's path first reaches, the last token's that of the one
    before it."""
    rows = weights[:, num_prompt:, : num_frames // 2].float()
    count = weights.shape[1] - num_prompt + 1  # the reply's tokens
    if rows.shape[1] == 0:
        return [0.0] * count
    std, mean = torch.std_mean(rows, dim=-2, keepdim=True, correction=0)
    matrix = median_filter((rows - mean) / std, median_width).mean(0)
    text, time = dynamic_time_warping(-matrix)
    jumps = np.pad(np.diff(text), (1, 0), constant_values=1).astype(bool)
    times = [float(np.float32(t * TIME_PRECISION)) for t in time[jumps]]
    return times + times[-1:]


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """The median of each `width` values around each along the last dimension, the edges
    reflected."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    return F.pad(x, (pad, pad), mode="reflect").unfold(-1, width, 1).sort()[0][..., pad]


def dynamic_time_warping(cost: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotone path through a [tokens, frames] cost matrix (float32), as its
    (token, frame) indices from the start, with transformers' ties (kernels.dtw): on the GPU
    one Triton kernel on the matrix where it lies, on the CPU numpy's anti-diagonals."""
    # (imported here: triton loads where the kernel path runs)
    from kernels import dtw_trace, dtw_trace_ref, warp_path

    trace = dtw_trace(cost) if cost.is_cuda else dtw_trace_ref(cost)
    return warp_path(trace)


def whisper_rules(generation_config: dict, tokenizer, vocab_size: int) -> WhisperRules:
    """The rules of a checkpoint's generation_config.json (its no_timestamps_token_id, else the
    tokenizer's <|notimestamps|>), the start its tokenizer's <|startoftranscript|>. Tokens it
    names past the model's `vocab_size` are no tokens to mask (transformers' processors pass
    over them too)."""
    no_timestamps = generation_config.get("no_timestamps_token_id")
    if no_timestamps is None and "<|notimestamps|>" in tokenizer.get_vocab():
        no_timestamps = tokenizer.convert_tokens_to_ids("<|notimestamps|>")
    eos = generation_config.get("eos_token_id", tokenizer.eos_token_id)
    multilingual = generation_config.get("is_multilingual", True)  # (an English-only one has no language step)
    def tokens(name: str) -> list[int]:
        return sorted({int(t) for t in generation_config.get(name) or [] if 0 <= int(t) < vocab_size})

    return WhisperRules(no_timestamps, eos[0] if isinstance(eos, list) else eos, tokens("begin_suppress_tokens"),
                        generation_config.get("max_initial_timestamp_index"),
                        tokenizer.get_vocab().get("<|startoftranscript|>") if multilingual else None,
                        tokens("suppress_tokens"))


@dataclass
class CrossStep:
    """A step's cross-attention inputs: each request's rows [start, end) of the flat batch and
    its slot in `states`."""

    states: CrossStates
    segments: list[tuple[int, int, int]]


class CrossStates:
    """The keys and values of each running request's audio for every decoder layer, a slot each
    of `max_requests`: [slots, layers, encoder positions, hidden] twice, in the model's dtype.
    A request takes a slot when its first step runs (its encoder and the projections run then)
    and gives it back when it ends or is preempted (it is computed again when it resumes).
    (Allocated empty: on the CPU the memory of slots never used is never touched.)"""

    def __init__(self, num_layers: int, max_requests: int, positions: int, hidden: int, dtype: torch.dtype,
                 device: torch.device):
        self.keys = torch.empty(max_requests, num_layers, positions, hidden, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.slots: dict[str, int] = {}
        self.free = list(range(max_requests - 1, -1, -1))

    @staticmethod
    def slot_bytes(num_layers: int, positions: int, hidden: int, dtype: torch.dtype) -> int:
        """What one request's keys and values take."""
        return 2 * num_layers * positions * hidden * dtype.itemsize

    def __len__(self) -> int:
        return self.keys.shape[0]

    def store(self, request_id: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A request's keys and values ([layers, positions, hidden] each) into a slot of its own."""
        slot = self.slots.get(request_id)
        if slot is None:
            slot = self.slots[request_id] = self.free.pop()
        self.keys[slot].copy_(keys)
        self.values[slot].copy_(values)

    def remove(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.index, self.span, self.eps = index, cfg.layer_span(index), cfg.rms_norm_eps
        self.self_attn = _Attention(hidden, heads)
        self.self_attn_layer_norm = nn.LayerNorm(hidden)
        self.encoder_attn = _Attention(hidden, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, hidden)
        self.final_layer_norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta, cross: CrossStep
                ) -> torch.Tensor:  # x: [T, hidden]
        attn, T = self.self_attn, x.shape[0]
        h = self.self_attn_layer_norm(x)
        q = attn.q_proj(h).view(T, attn.heads, attn.head_dim)
        k = attn.k_proj(h).view(T, attn.heads, attn.head_dim)
        v = attn.v_proj(h).view(T, attn.heads, attn.head_dim)
        o = meta.forward(q, k, v, kv_cache, attn.head_dim**-0.5, self.span, None, None)
        x = x + attn.out_proj(o.reshape(T, -1))
        x = x + self._cross(self.encoder_attn_layer_norm(x), cross)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))

    def _cross(self, h: torch.Tensor, cross: CrossStep) -> torch.Tensor:
        """Each request's rows attend to its audio's keys and values (all of them: no mask)."""
        attn = self.encoder_attn
        q = attn.q_proj(h).view(h.shape[0], attn.heads, attn.head_dim).transpose(0, 1)  # [heads, T, D]
        out = torch.empty_like(q)
        keys, values = cross.states.keys, cross.states.values
        for start, end, slot in cross.segments:
            k = keys[slot, self.index].view(-1, attn.heads, attn.head_dim).transpose(0, 1)  # [heads, S, D]
            v = values[slot, self.index].view(-1, attn.heads, attn.head_dim).transpose(0, 1)
            out[:, start:end] = F.scaled_dot_product_attention(q[:, start:end], k, v)
        return attn.out_proj(out.transpose(0, 1).reshape(h.shape[0], -1))


class WhisperForConditionalGeneration(nn.Module):
    """`use_kernels` is taken for the runner's sake: the decoder runs torch ops everywhere
    (its attention goes through the step's backend)."""

    encoder_decoder = True

    def __init__(self, cfg: ModelConfig, use_kernels: bool = False):
        super().__init__()
        self.config = cfg
        self.use_kernels = False
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                            _weight=torch.empty(cfg.max_position_embeddings, cfg.hidden_size))
        self.layers = nn.ModuleList(WhisperDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.layer_norm = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = self.embed_tokens  # (the runner ties it again after loading)
        self.aux_layers: tuple[int, ...] = ()
        self.aux: torch.Tensor | None = None
        self.cross: CrossStep | None = None  # set by the runner before each step
        self.logits_buffer = LogitsBuffer()

    def build_rotary(self, device: torch.device) -> None:
        """No rotary tables: positions are learned."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta, lora=None, images=None) -> torch.Tensor:  # [T, hidden]
        assert self.cross is not None, "the runner sets the step's cross-attention inputs"
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, kv_cache, meta.for_layer(i), self.cross)
        return self.layer_norm(x)

    @torch.inference_mode()
    def cross_attention_weights(self, token_ids: list[int], keys: torch.Tensor, values: torch.Tensor,
                                heads: list[tuple[int, int]]) -> torch.Tensor:
        """How much each position of a whole sequence, run at once, attends to each of its
        audio's positions, in the cross-attention heads named ((layer, head) each):
        [len(heads), len(token_ids), audio positions], float32. The decoder as a step runs it,
        its own attention causal over the sequence; `keys`, `values`: the request's audio's
        ([layers, positions, hidden] each, CrossStates')."""
        ids = torch.tensor(token_ids, device=keys.device)
        x = self.embed_tokens(ids) + self.embed_positions(torch.arange(len(token_ids), device=keys.device))
        wanted: dict[tuple[int, int], torch.Tensor] = {}
        for layer in cast(list[WhisperDecoderLayer], list(self.layers)):
            attn, T = layer.self_attn, x.shape[0]
            h = layer.self_attn_layer_norm(x)
            q, k, v = (proj(h).view(T, attn.heads, attn.head_dim).transpose(0, 1)
                       for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            x = x + attn.out_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, -1))
            cross = layer.encoder_attn
            q = cross.q_proj(layer.encoder_attn_layer_norm(x)).view(T, cross.heads, cross.head_dim).transpose(0, 1)
            k = keys[layer.index].view(-1, cross.heads, cross.head_dim).transpose(0, 1)
            v = values[layer.index].view(-1, cross.heads, cross.head_dim).transpose(0, 1)
            weights = ((q.float() @ k.float().transpose(1, 2)) * cross.head_dim**-0.5).softmax(-1)  # [heads, T, S]
            wanted.update({(i, head): weights[head] for i, head in heads if i == layer.index})
            x = x + cross.out_proj((weights.to(v.dtype) @ v).transpose(0, 1).reshape(T, -1))
            x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
        return torch.stack([wanted[head] for head in heads])

    @torch.inference_mode()
    def cross_kv(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values every layer's cross-attention reads for one clip's encoder output
        [positions, hidden]: [layers, positions, hidden] each."""
        layers = cast(list[WhisperDecoderLayer], list(self.layers))
        keys = [layer.encoder_attn.k_proj(encoded) for layer in layers]
        values = [layer.encoder_attn.v_proj(encoded) for layer in layers]
        return torch.stack(keys), torch.stack(values)

    def compute_logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        """[num_rows, vocab] float32; `reuse`: as LlamaForCausalLM's."""
        if reuse:
            return self.logits_buffer.logits(self._lm_head, hidden, self.config.vocab_size)
        return self._lm_head(hidden).float()

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embed_tokens.weight)

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float()

    def checkpoint_filter(self) -> Callable[[str], bool]:
        return lambda name: name.startswith(DECODER_PREFIX)

    def init_dummy_weights(self, std: float, seed: int = 0) -> None:
        """Seeded random weights: normal(0, std) matrices and embeddings, unit norms, zero biases."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if "layer_norm" in name and name.endswith(".weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.copy_(torch.randn(param.shape, generator=generator).mul_(std))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], split=None, deal=None) -> None:
        """The checkpoint's decoder tensors, by their names less `model.decoder.`; ValueError
        for one the model lacks or one the checkpoint lacks."""
        params = dict(self.named_parameters())
        loaded = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix(DECODER_PREFIX)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {', '.join(DECODER_PREFIX + n for n in missing[:5])}")
