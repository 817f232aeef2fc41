"""vLLM's `/classify` through a live worker serving a classification model: each input's
label probabilities equal the softmax of transformers' logits, and the likeliest label is
named as the model's config names it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from api.settings import Settings


@pytest.fixture(scope="module")
def live_worker(stack_redis, tiny_classifier_dir: Path, run_worker, tmp_path_factory) -> Iterator[str]:
    with run_worker(stack_redis.url, tiny_classifier_dir, tmp_path_factory.mktemp("classifier-worker")) as url:
        yield url


def test_classify_gives_each_inputs_label_probabilities(live_worker: str, serve_api, served_model: str,
                                                        tiny_classifier_dir: Path) -> None:
    texts = ["I loved it", "The weather report, read twice over: rain, then sun, then rain again."]
    with serve_api(Settings(redis_url=live_worker)) as url, httpx.Client(base_url=url, timeout=60) as http:
        reply = http.post("/classify", json={"model": served_model, "input": texts})
        one = http.post("/v1/classify", json={"input": texts[0]})
        empty = http.post("/classify", json={"input": []})
        generate = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        pooled = http.post("/pooling", json={"model": served_model, "input": texts})  # vLLM's: the raw logits
    assert reply.status_code == 200, reply.text
    body = reply.json()
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_classifier_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_classifier_dir)
    labels = ["negative", "neutral", "positive"]
    assert pooled.status_code == 200 and pooled.json()["object"] == "list"
    for i, (text, item, raw) in enumerate(zip(texts, body["data"], pooled.json()["data"], strict=True)):
        with torch.inference_mode():
            logits = hf(torch.tensor([tok.encode(text)])).logits[0]
        expected = logits.softmax(-1)
        assert (raw["index"], raw["object"]) == (i, "pooling")
        torch.testing.assert_close(torch.tensor(raw["data"]), logits, atol=1e-4, rtol=1e-4)
        assert item["index"] == i and item["num_classes"] == 3
        torch.testing.assert_close(torch.tensor(item["probs"]), expected, atol=1e-5, rtol=1e-4)
        assert item["label"] == labels[int(expected.argmax())]
    assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in texts)
    assert one.status_code == 200 and one.json()["data"][0]["probs"] == pytest.approx(body["data"][0]["probs"])
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    assert generate.status_code == 400 and "has no LM head" in generate.json()["error"]["message"], generate.text
