"""The worker's tokenizer, published in Redis (`genq:tokenizer:<served model>`: its files as
`save_pretrained` writes them, and their `digest`), so the API can count and decode tokens
(/tokenize, /detokenize) exactly as the workers do without loading the model."""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio

from producer.protocol import TOKENIZER_EOS_FIELD, TOKENIZER_LABELS_FIELD, Keys
from producer.redis_conn import pipeline

MAX_FILE_BYTES = 32 << 20  # a tokenizer file past this stays home (no tokenizer is near it)


async def publish_tokenizer(
    conn: redis.asyncio.Redis, keys: Keys, model_name: str, tokenizer: Any, eos_token_ids: Iterable[int] = (),
    labels: Sequence[str] = (),
) -> None:
    """Write the tokenizer's files unless the same ones are there (every worker of a pool
    starts with the same model), with the ids that end a sequence for the model (its
    generation config's and the tokenizer's), for the API's beam search, and a
    classification model's labels, for its /classify."""
    files = await asyncio.to_thread(tokenizer_files, tokenizer)
    files[TOKENIZER_EOS_FIELD] = ",".join(str(t) for t in sorted(eos_token_ids)).encode()
    if labels:
        files[TOKENIZER_LABELS_FIELD] = json.dumps(list(labels)).encode()
    digest = hashlib.sha256(b"".join(name.encode() + b"\0" + data for name, data in sorted(files.items()))).hexdigest()
    key = keys.tokenizer(model_name)
    if (await conn.hget(key, "digest")) == digest.encode():  # type: ignore[misc]
        return
    pipe = pipeline(conn)
    pipe.delete(key)
    pipe.hset(key, mapping={**files, "digest": digest})
    await pipe.execute()


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory(prefix="genq-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        return {path.name: path.read_bytes() for path in sorted(Path(tmp).iterdir())
                if path.is_file() and path.stat().st_size <= MAX_FILE_BYTES}
