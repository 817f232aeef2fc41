"""Running pooling jobs (each input one embedding job, api.embeddings plans and renders them):
OpenAI's `/v1/embeddings` and vLLM's `/pooling`; vLLM's `/score` and `/rerank` (the Cohere and
Jina shapes) for embedding models, where each text is embedded once and a pair's score is the
cosine similarity of its two vectors, as vLLM scores pairs with an embedding model; and vLLM's
`/classify` for classification models (reward models, classifiers), whose vector is the score
head's logits: the response gives their softmax and the likeliest label."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from api import generate, tokenizers
from api.deps import AppState
from api.embeddings import EmbeddingRenderer, encoded, plan_embeddings
from api.errors import invalid_param
from api.request_bodies import EmbeddingRequest
from api.sse import unless_disconnected


async def embeddings_response(state: AppState, body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    """OpenAI's embeddings response, its vectors as `encoding_format` asks."""
    return encoded(await _pooled(state, body, request), body.encoding_format)


async def _pooled(state: AppState, body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    """The embeddings response: one job per input, each vector as its worker pooled it."""
    model = await generate.resolve_model(state, body.model)
    await generate.check_backpressure(state)
    job_model = await generate.job_model(state, body.model, model)
    planned = plan_embeddings(body, uuid.uuid4().hex, model, job_model)
    req = await generate.submit(state, planned)
    return await unless_disconnected(request, generate.collect(state, req, EmbeddingRenderer()))


async def pooling_response(state: AppState, body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    """vLLM's `/pooling`: each input's pooler output as it is (an embedding model's vector, a
    classifier's logits), in vLLM's shape; the inputs as /v1/embeddings takes them."""
    response = encoded(await _pooled(state, body, request), body.encoding_format)
    data = [{"index": item["index"], "object": "pooling", "data": item["embedding"]} for item in response["data"]]
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": response["model"],
            "data": data, "usage": response["usage"]}


class ScoreRequest(BaseModel):
    """`text_1` against `text_2`: one against each of a list, or two lists pair by pair."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankRequest(BaseModel):
    """The documents ordered by their score against the query; the `top_n` best."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None  # None or 0: all
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ClassificationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = 0


async def classify(state: AppState, body: ClassificationRequest, request: Request) -> dict[str, Any]:
    """vLLM's /classify: each input's label probabilities (the softmax of its score head's logits)."""
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise invalid_param("input", "input must be a text or a non-empty list of texts")
    _check_texts("input", texts)
    model = await generate.resolve_model(state, body.model)
    labels = await tokenizers.labels(state.client, model)
    if labels is None:
        raise invalid_param("model", f"model {model!r} has no classification head (its workers publish no labels)")
    await generate.check_backpressure(state)
    embed = EmbeddingRequest(model=body.model, input=texts, truncate_prompt_tokens=body.truncate_prompt_tokens,
                             priority=body.priority)
    planned = plan_embeddings(embed, uuid.uuid4().hex, model, await generate.job_model(state, body.model, model))
    req = await generate.submit(state, planned)
    response = await unless_disconnected(request, generate.collect(state, req, EmbeddingRenderer()))
    data = []
    for i, item in enumerate(response["data"]):
        probs = _softmax(item["embedding"])
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best], "probs": probs, "num_classes": len(probs)})
    tokens = response["usage"]["prompt_tokens"]
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


def _softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]


async def score(state: AppState, body: ScoreRequest, request: Request) -> dict[str, Any]:
    """vLLM's /score: the cosine similarity of each pair of texts."""
    left = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    right = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if len(left) == 1:
        left = left * len(right)
    for name, texts in (("text_1", left), ("text_2", right)):
        _check_texts(name, texts)
    if not right or len(left) != len(right):
        raise invalid_param("text_2", f"text_1 ({len(left)}) and text_2 ({len(right)}) must pair up: "
                                      "one text against a list, or two lists of one length")
    model, scores, tokens = await _scores(state, request, body.model, left, right, body.truncate_prompt_tokens,
                                          body.priority)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


async def rerank(state: AppState, body: RerankRequest, request: Request) -> dict[str, Any]:
    """vLLM's /rerank: the documents by their score against the query."""
    _check_texts("query", [body.query])
    if not body.documents:
        raise invalid_param("documents", "documents must be a non-empty list of texts")
    _check_texts("documents", body.documents)
    if body.top_n is not None and body.top_n < 0:
        raise invalid_param("top_n", f"top_n must be >= 0, got {body.top_n}")
    model, scores, tokens = await _scores(state, request, body.model, [body.query] * len(body.documents),
                                          body.documents, body.truncate_prompt_tokens, body.priority)
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in ranked]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
            "usage": {"total_tokens": tokens}}


async def _scores(
    state: AppState, request: Request, requested: str | None, left: list[str], right: list[str],
    truncate: int | None, priority: int,
) -> tuple[str, list[float], int]:
    """(the model, each pair's cosine similarity, the prompt tokens embedded): every distinct
    text is one embedding job."""
    texts = list(dict.fromkeys(left + right))
    body = EmbeddingRequest(model=requested, input=texts, truncate_prompt_tokens=truncate, priority=priority)
    model = await generate.resolve_model(state, requested)
    await generate.check_backpressure(state)
    planned = plan_embeddings(body, uuid.uuid4().hex, model, await generate.job_model(state, requested, model))
    req = await generate.submit(state, planned)
    response = await unless_disconnected(request, generate.collect(state, req, EmbeddingRenderer()))
    vectors = {text: item["embedding"] for text, item in zip(texts, response["data"], strict=True)}
    scores = [_cosine(vectors[a], vectors[b]) for a, b in zip(left, right, strict=True)]
    return model, scores, response["usage"]["prompt_tokens"]


def _check_texts(name: str, texts: list[str]) -> None:
    if not all(texts):
        raise invalid_param(name, f"{name} must hold non-empty texts")


def _cosine(a: list[float], b: list[float]) -> float:
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norms if norms else 0.0
