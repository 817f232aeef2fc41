"""Logprobs as OpenAI shows them, from what genq workers send. Plain functions of plain data.

The worker sends, per new token, either {token_id: logprob} for the top tokens or a mapping
with "logprob", "top_logprobs" ({token_id: logprob}) and optionally "token" and "decoded"
({token_id: text}). Tokens without text are shown as "token_id:<id>", as vLLM does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from producer.protocol import Event

MIN_LOGPROB = -9999.0  # stands for -inf, which JSON cannot carry (as vLLM does)


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float | None  # None only for an echoed prompt's first token: nothing precedes it
    top: list[tuple[str, float]]  # most likely first
    spelled: str = ""  # the token decoded alone, when the worker sent it ("" otherwise)
    token_id: int | None = None
    top_ids: tuple[int, ...] = ()  # the ids of `top`'s tokens

    def as_token_ids(self) -> TokenLogprob:
        """Tokens named "token_id:<id>" rather than by their text (vLLM's
        return_tokens_as_token_ids: every token is then told apart, and JSON-safe)."""
        token = self.token if self.token_id is None else _token_text(self.token_id)
        top = [(_token_text(t), lp) for t, (_, lp) in zip(self.top_ids, self.top, strict=True)]
        return replace(self, token=token, top=top)


def event_logprobs(event: Event) -> list[TokenLogprob]:
    if not event.logprobs:
        return []
    return [token_logprob(t, e) for t, e in zip(event.token_ids, event.logprobs, strict=False)]


def token_logprob(token_id: int, entry: Any) -> TokenLogprob:
    if isinstance(entry, dict) and "logprob" in entry:
        spelled = entry.get("token") or (entry.get("decoded") or {}).get(token_id) or ""
        return _mapped(entry, spelled or _token_text(token_id), spelled, token_id)
    top = top_token_pairs(entry)
    logprob = dict(top).get(token_id, MIN_LOGPROB) if not _is_number(entry) else entry
    return TokenLogprob(_token_text(token_id), _finite(logprob), _named(top, {}), token_id=token_id,
                        top_ids=tuple(t for t, _ in top))


def prompt_logprobs(entries: list[Any] | None) -> list[TokenLogprob]:
    """An event's `prompt_logprobs`: each prompt token as the worker spelled it (the first
    one without a logprob)."""
    out = []
    for entry in entries or []:
        mapping = entry if isinstance(entry, dict) else {}
        spelled = mapping.get("token") or ""
        out.append(_mapped(mapping, spelled, spelled, mapping.get("token_id")))
    return out


def _mapped(entry: dict[str, Any], token: str, spelled: str, token_id: int | None) -> TokenLogprob:
    logprob = entry.get("logprob")
    pairs = top_token_pairs(entry.get("top_logprobs"))
    top = _named(pairs, entry.get("decoded") or {})
    return TokenLogprob(token, None if logprob is None else _finite(logprob), top, spelled, token_id,
                        tuple(t for t, _ in pairs))


def top_token_pairs(top: Any) -> list[tuple[int, float]]:
    """A `top_logprobs` as the wire carries it, as (token id, logprob) pairs, most likely first."""
    if isinstance(top, dict):
        pairs = [(int(k), v) for k, v in top.items()]
    elif isinstance(top, list):
        pairs = [(int(t["token_id"]), t["logprob"]) for t in top if isinstance(t, dict)]
    else:
        pairs = []
    return sorted(pairs, key=lambda p: -p[1])


def _named(pairs: list[tuple[int, float]], decoded: dict[Any, str]) -> list[tuple[str, float]]:
    return [(decoded.get(t) or _token_text(t), _finite(lp)) for t, lp in pairs]


def _token_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> float:
    value = float(value)
    return value if math.isfinite(value) else MIN_LOGPROB


def vllm_prompt_logprobs(entries: list[Any] | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """An event's `prompt_logprobs` in vLLM's response form."""
    if entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries[1:]:
        if not isinstance(entry, dict) or entry.get("logprob") is None:
            out.append(None)  # not in genq's form: nothing to show rather than a failed response
            continue
        decoded = entry.get("decoded") or {}
        position = {
            str(token_id): {"logprob": _finite(logprob), "rank": rank, "decoded_token": decoded.get(token_id)}
            for rank, (token_id, logprob) in enumerate(top_token_pairs(entry.get("top_logprobs")), 1)
        }
        if "token_id" in entry:
            position[str(entry["token_id"])] = {
                "logprob": _finite(entry["logprob"]), "rank": entry.get("rank"),
                "decoded_token": entry.get("token"),
            }
        out.append(position)
    return out


def completion_logprobs(
    logprobs: list[TokenLogprob], offsets: list[int], k: int | None
) -> dict[str, Any]:
    """OpenAI's legacy form; `top_logprobs` holds the k most likely and the sampled token."""
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            None if lp.logprob is None else {**dict(lp.top[:k]), lp.token: lp.logprob}
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: list[TokenLogprob], k: int | None) -> dict[str, Any]:
    """OpenAI's chat form; `top_logprobs` holds exactly the k most likely."""

    def item(token: str, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**item(lp.token, lp.logprob), "top_logprobs": [item(t, v) for t, v in lp.top[:k]]}
            for lp in logprobs
        ]
    }
