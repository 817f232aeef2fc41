"""Incremental detokenization and stop strings for one completion.

Each engine step hands the new token ids of a request to `IncrementalDetokenizer.update`, which
returns the text to stream. The deltas concatenate exactly to
`tokenizer.decode(output_ids, skip_special_tokens=...)` once the request ends, truncated at a
matched stop string (and kept up to its end with `include_stop_str_in_output`).

Decoding is windowed, so a step costs O(new tokens), not O(output): like vLLM's prefix/read
offsets, the window `ids[prefix_offset:]` starts a little before the unread tokens, and the new
text is what the window decodes to beyond `ids[prefix_offset:read_offset]`. Decoding from
`prefix_offset` rather than `read_offset` gives the first unread token its context: the
decoders of SentencePiece models strip the leading space of the first token they see, and a
byte-level token may continue a character begun before it. Text is released only when the
window ends on a complete character, so a multi-byte character split across tokens never
streams as U+FFFD.

The state after each token depends only on the token ids so far, not on how they were grouped
into `update` calls; that is what lets a resumed job (`initial_output_token_ids`) replay its
tokens and continue with exactly the text the first worker would have sent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from producer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT_CHAR = "\ufffd"
_UNSEEN: Any = object()  # an _own_texts entry not there yet


class IncrementalDetokenizer:
    """Text deltas and stop-string detection for one completion.

    `output_text` is the text sent so far (the concatenation of all deltas, including the text
    for `initial_output_token_ids`). Up to (longest stop string - 1) trailing characters are
    held back while they could still begin a stop string; `flush()` releases them when the
    request ends for another reason (length, EOS, stop token, cancel).

    Callers pass every token they want in the text: a stop token (EOS, stop_token_ids) that
    should not appear in the text must not be passed.
    """

    # (one per running request, each read every step: its fields in the object, not a dict beside it)
    __slots__ = ("_finished", "_include_stop", "_longest_stop", "_merging_ids", "_min_tokens", "_num_sent",
                 "_own_texts", "_prefix_len", "_prefix_offset", "_read_offset", "_rust_decode",
                 "_skip_special_tokens", "_stop", "_text", "_token_text_lens", "_tokenizer", "stop_reason",
                 "token_ids")

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        initial_output_token_ids: Sequence[int] = (),
    ) -> None:
        # prompt_token_ids are deliberately not used as decoding context: the output text must
        # equal decode(output ids) alone, and a SentencePiece decoder given the prompt's tail
        # would keep a leading space that decode(output ids) strips.
        del prompt_token_ids
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = tuple(params.stop)
        self._longest_stop = max((len(stop) for stop in self._stop), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._merging_ids = _merging_token_ids(tokenizer, params.skip_special_tokens)
        self._rust_decode = _rust_decode(tokenizer)
        self._token_text_lens = _token_text_lens(tokenizer, params.skip_special_tokens)
        # a byte-level decoder's tokens, each one's text alone where it stands alone (None if not)
        self._own_texts = _own_texts(tokenizer, params.skip_special_tokens) if _byte_level(tokenizer) else None
        self.token_ids: list[int] = []  # all output ids, including the initial ones
        self._prefix_offset = 0  # window start: ids[prefix_offset:] are decoded each step
        self._read_offset = 0  # ids before it have produced their text
        self._prefix_len = 0  # len(decode(ids[prefix_offset:read_offset]))
        self._text = ""  # decoded text up to read_offset (cut at a matched stop string)
        self._num_sent = 0  # leading characters of _text already returned
        self._finished = False
        self.stop_reason: str | None = None  # the stop string matched, if any
        self.update(initial_output_token_ids)  # its text was sent by the previous worker

    @property
    def output_text(self) -> str:
        return self._text[: self._num_sent]

    @property
    def num_tokens_at_stop(self) -> int:
        """After a stop string matched: the output tokens read up to the one completing it."""
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        """True after a stop string matched or flush(); later updates return ""."""
        return self._finished

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add the tokens generated this step; return the text newly safe to send.

        After it returns, `stop_reason` is set if a stop string matched: the caller finishes
        the request with finish_reason "stop" (tokens after the match are ignored).
        """
        start = self._num_sent
        for token_id in new_token_ids:
            if self._finished:
                break
            self._add_token(token_id)
        return self._text[start : self._num_sent]

    def flush(self) -> str:
        """Release the text still held back; call once when the request ends without a stop
        string. Returns "" if a stop string already ended it."""
        if self._finished:
            return ""
        self._finished = True
        start = self._num_sent
        # An incomplete character at the very end decodes to U+FFFD, as decode() of the whole does.
        window = self._decode(self.token_ids[self._prefix_offset :])
        self._text += window[self._prefix_len :]
        self._num_sent = len(self._text)
        return self._text[start:]

    def _add_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        new_text = self._read_new_text()
        if not new_text:
            return
        text = self._text
        num_checked = len(text)
        self._text = ""  # (the local's the only reference: += extends the text in place, not a copy a token)
        text += new_text
        self._text = text
        # As vLLM: a stop string counts once the output is longer than min_tokens (the same
        # token count at which EOS and stop ids stop being masked).
        if not self._stop:  # nothing to hold back
            self._num_sent = len(self._text)
        elif len(self.token_ids) <= self._min_tokens or not self._match_stop(num_checked):
            self._num_sent = len(self._text) - self._held_back_len()

    def _read_new_text(self) -> str:
        """Text that the unread tokens add, or "" while it may still change."""
        ids = self.token_ids
        if ids[-1] in self._merging_ids:
            return ""  # a byte-fallback run may go on and decode differently as a whole
        if self._own_texts is not None and self._read_offset == len(ids) - 1:
            # (a token seen before, the common one: its entry read here, not through _own_text)
            text = self._own_texts.get(ids[-1], _UNSEEN)
            if text is _UNSEEN:
                text = self._own_text(ids[-1])
            if text is not None:  # what the window would decode to beyond its prefix
                if text:
                    self._prefix_offset, self._read_offset, self._prefix_len = self._read_offset, len(ids), len(text)
                return text
        window = self._decode(ids[self._prefix_offset :])
        if len(window) <= self._prefix_len or window.endswith(_REPLACEMENT_CHAR):
            return ""  # no text yet, or a character whose remaining bytes are to come
        new_text = window[self._prefix_len :]
        # The unread tokens produced text, so they are context enough for the next window.
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self._prefix_len = self._text_len(self._prefix_offset, self._read_offset)
        return new_text

    def _own_text(self, token_id: int) -> str | None:
        """The token's text where it is the same after any whole characters: a byte-level
        decoder maps each token to its own bytes and decodes their concatenation, so a token whose
        bytes are whole characters adds exactly its own text (None for one that is not: a piece of
        a character, or a token whose text is U+FFFD for good, which the window then decodes)."""
        texts = self._own_texts
        assert texts is not None
        text = texts.get(token_id, "")
        if text == "" and token_id not in texts:
            own = self._decode([token_id])
            text = texts[token_id] = None if _REPLACEMENT_CHAR in own else own
        return text

    def _text_len(self, start: int, end: int) -> int:
        """len(decode(token_ids[start:end])); one token's (the next window's prefix when every
        token releases text, the common case) from the tokenizer's table, filled as ids are seen."""
        if end - start != 1:
            return len(self._decode(self.token_ids[start:end]))
        token_id = self.token_ids[start]
        text_len = self._token_text_lens.get(token_id)
        if text_len is None:
            text_len = self._token_text_lens[token_id] = len(self._decode([token_id]))
        return text_len

    def _match_stop(self, num_checked: int) -> bool:
        """Cut the text at the earliest stop string ending after num_checked characters."""
        match = find_stop_string(self._text, num_checked, self._stop)
        if match is None:
            return False
        index, stop = match
        # The hold-back guarantees index >= _num_sent: text that could begin a stop string
        # was never sent.
        self._text = self._text[: index + len(stop) if self._include_stop else index]
        self._num_sent = len(self._text)
        self.stop_reason = stop
        self._finished = True
        return True

    def _held_back_len(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of a stop string."""
        for length in range(min(self._longest_stop - 1, len(self._text) - self._num_sent), 0, -1):
            suffix = self._text[-length:]
            if any(stop.startswith(suffix) for stop in self._stop):
                return length
        return 0

    def _decode(self, token_ids: list[int]) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        # Cleanup of tokenization spaces rewrites text across token boundaries, so it cannot
        # be applied incrementally; the default tokenizer does not use it.
        text = self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str)  # a flat id list decodes to one string
        return text


def find_stop_string(text: str, num_checked: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest (index, stop) whose match ends beyond text[:num_checked], or None.

    Matches that end within the first num_checked characters were looked for already (or came
    before min_tokens and do not count); ties go to the stop listed first.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, num_checked - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


@functools.lru_cache(maxsize=8)
def _rust_decode(tokenizer: PreTrainedTokenizerBase) -> Callable[..., str] | None:
    """The Rust tokenizer's own decode, where transformers' adds nothing to it but the cleanup of
    tokenization spaces, which the windows never ask for: a fast tokenizer whose `_decode` is
    the base class's. Each step decodes a window of every request, and the wrapper's
    conversions of the ids cost more than the decode itself (benchmarks/step_overhead.py).
    None for any other tokenizer (a slow one, Mistral's, a class with its own `_decode`)."""
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, PreTrainedTokenizerFast) and type(tokenizer)._decode is PreTrainedTokenizerFast._decode:
        return tokenizer.backend_tokenizer.decode
    return None


@functools.lru_cache(maxsize=8)
def _token_text_lens(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> dict[int, int]:
    """len(decode([id])) per token id seen so far, shared by the detokenizers of a tokenizer.

    A token's text alone depends only on the tokenizer, which the engine never changes, so an
    entry cannot go stale; it holds at most one int per vocabulary id. Saves one of the two
    decodes a token costs (benchmarks/step_overhead.py's output processing).
    """
    del tokenizer, skip_special_tokens  # the cache's key
    return {}


@functools.lru_cache(maxsize=8)
def _byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    """The Rust tokenizer decodes, with a byte-level decoder alone (GPT-2's, Llama 3's,
    SmolLM2's): a token's text after whole characters does not depend on the tokens before it."""
    from tokenizers.decoders import ByteLevel

    return _rust_decode(tokenizer) is not None and isinstance(tokenizer.backend_tokenizer.decoder, ByteLevel)


@functools.lru_cache(maxsize=8)
def _own_texts(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> dict[int, str | None]:
    """decode([id]) per token id seen so far where its bytes are whole characters (None where
    not), shared by the detokenizers of a byte-level tokenizer (_byte_level): for the common token,
    its text without a decode. Bounded by the vocabulary, never stale, as _token_text_lens."""
    del tokenizer, skip_special_tokens  # the cache's key
    return {}


@functools.lru_cache(maxsize=8)
def _merging_token_ids(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> frozenset[int]:
    """Ids whose text can change with the tokens after them, beyond an incomplete character.

    SentencePiece byte fallback decodes a run of byte tokens (<0xE4><0xB8>...) as a whole, and
    as one U+FFFD per byte when the run is not valid UTF-8; a skipped special token inside a
    run joins its two halves. So text is not released while the last token is one of these.
    Byte-level BPE needs none: its text is fixed once the window ends on a whole character.
    """
    vocab = tokenizer.get_vocab()
    byte_ids = {vocab[f"<0x{b:02X}>"] for b in range(256) if f"<0x{b:02X}>" in vocab}
    if not byte_ids:
        return frozenset()
    special_ids: set[int] = set()
    if skip_special_tokens:
        special_ids = set(tokenizer.all_special_ids) | {
            token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special
        }
    return frozenset(byte_ids | special_ids)
