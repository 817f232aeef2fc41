"""The bytes each vocabulary token stands for, which guided decoding matches grammars against.

Decoding a token alone gives text only for tokens that hold whole characters: a byte-level
token holding the first two bytes of "日" decodes to U+FFFD, and so does a SentencePiece
byte-fallback token `<0xE6>`. A grammar over text would have to refuse such tokens, and then
a model whose vocabulary has "日" only in pieces could never write it. Over bytes every token
has an exact meaning, and a grammar checks that the pieces add up to whole characters.

Three vocabulary forms are read from the tokenizer's decoder:
- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): each byte is written as a printable
  stand-in character, and the token's string maps back byte by byte;
- SentencePiece with byte fallback (Llama 2, Mistral): `<0xHH>` is one byte, `▁` a space;
- anything else: the token decoded alone, as UTF-8 (tokens that decode to U+FFFD are left
  out, as before).
Added tokens that are not special (Qwen's `<tool_call>`) are their own text.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


def byte_text(data: bytes) -> str:
    """Bytes as the grammars read them: one character per byte (Latin-1), so structural
    JSON stays ASCII and anything else is seen byte by byte."""
    return data.decode("latin-1")


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """Per token id: the bytes it stands for, or None for special tokens (never inside
    guided output: `skip_special_tokens` would drop them from the text) and tokens whose
    bytes cannot be told."""
    size = len(tokenizer)
    added_tokens = tokenizer.added_tokens_decoder.items()
    special = set(tokenizer.all_special_ids) | {i for i, t in added_tokens if t.special}
    added = {i: t.content for i, t in added_tokens}
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    form = _vocabulary_form(tokenizer)
    out: list[bytes | None] = []
    for token_id, piece in enumerate(pieces):
        if token_id in special or piece is None:
            out.append(None)
        elif token_id in added:
            out.append(added[token_id].encode())
        elif form == "byte_level":
            out.append(_from_byte_level(piece))
        elif form == "byte_fallback":
            match = _BYTE_FALLBACK.fullmatch(piece)
            out.append(bytes([int(match.group(1), 16)]) if match else piece.replace(_METASPACE, " ").encode())
        else:
            text = tokenizer.decode([token_id])
            out.append(None if "\ufffd" in text else text.encode())
    return out


def special_texts(tokenizer: Any) -> dict[int, str]:
    """Per special token id: how it is written (`<|im_start|>`), which `token_bytes` leaves
    out of the vocabulary guided output may use."""
    texts = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for token_id in tokenizer.all_special_ids:
        texts.setdefault(token_id, tokenizer.convert_ids_to_tokens(token_id))
    return texts


def _vocabulary_form(tokenizer: Any) -> str:
    """"byte_level", "byte_fallback" or "text", from the fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "text"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [])} | {decoder.get("type")}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds:
        return "byte_fallback"
    return "text"


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's stand-ins: a byte that is a printable Latin-1 character other than
    space and soft hyphen stands for itself; the other 68 bytes, in order, take the
    characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return table


_BYTE_LEVEL = _byte_level_table()


def _from_byte_level(piece: str) -> bytes | None:
    try:
        return bytes(_BYTE_LEVEL[c] for c in piece)
    except KeyError:  # not a byte-level piece after all
        return None
