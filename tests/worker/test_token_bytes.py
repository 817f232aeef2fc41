"""Each token's bytes, against the tokenizer's own decoding as the oracle."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from worker.guided.token_bytes import special_texts, token_bytes

TEXTS = ["naïve café — 日本語のテキスト 🙂", "plain ascii, with  spaces\n\tand tabs", "Ünïcödé ŝtrïñg ∑ √ ∞"]


def test_byte_level_tokens_spell_what_the_tokenizer_decodes(default_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    vocabulary = token_bytes(tokenizer)
    assert len(vocabulary) == len(tokenizer)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert {i for i, b in enumerate(vocabulary) if b is None} == special
    pieces = 0
    for token_id, data in enumerate(vocabulary):
        if data is None:
            continue
        alone = tokenizer.decode([token_id])
        if "\ufffd" in alone:  # part of a character: its bytes are what decoding lost
            pieces += 1
            assert data.decode(errors="replace") == alone and not data.isascii()
        else:
            assert data.decode() == alone, token_id
    assert pieces > 100  # byte pieces of characters the vocabulary holds only in parts
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(vocabulary[i] for i in ids) == text.encode()


def test_special_tokens_are_spelled_as_the_tokenizer_writes_them(default_model_dir: Path) -> None:
    """What markers see of the tokens token_bytes leaves out: the text the tokenizer writes
    for each with skip_special_tokens off."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    texts = special_texts(tokenizer)
    assert set(texts) == {i for i, b in enumerate(token_bytes(tokenizer)) if b is None}
    for token_id, text in texts.items():
        assert tokenizer.decode([token_id], skip_special_tokens=False) == text
    assert texts[tokenizer.convert_tokens_to_ids("<|im_start|>")] == "<|im_start|>"


def test_sentencepiece_byte_fallback_tokens() -> None:
    """A Llama-2-style vocabulary: characters it lacks fall back to <0xHH> byte tokens, and ▁
    stands for a space (the decoder strips the one it adds at the start)."""
    chars = sorted(set("▁helowrd"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({c: len(vocab) + i for i, c in enumerate(chars)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    vocabulary = token_bytes(tokenizer)
    assert vocabulary[0] is None and vocabulary[2] is None  # special
    assert vocabulary[3 + 0xE6] == b"\xe6" and vocabulary[vocab["▁"]] == b" "
    for text in ("hello world", "hello 日本 wörld"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert any(3 <= i < 259 for i in ids) == (not text.isascii())
        spelled = b"".join(vocabulary[i] for i in ids).decode()
        assert spelled == " " + tokenizer.decode(ids) == " " + text
