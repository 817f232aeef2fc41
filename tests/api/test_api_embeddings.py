"""`POST /v1/embeddings` through a live stack, with the official OpenAI client: one embedding
job per input, answered with the normalized last hidden state of each prompt. The oracle is
transformers' `last_hidden_state` for the same tokens."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import httpx
import openai
import pytest
import torch


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):
    """`hf(text_or_ids)`: (token ids, transformers' last hidden state of the last token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)

    @torch.inference_mode()
    def hidden(prompt: str | list[int]) -> tuple[list[int], torch.Tensor]:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return ids, model.model(torch.tensor([ids])).last_hidden_state[0, -1]

    return hidden


def normalized(vector: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vector, dim=-1)


def test_embeddings_match_transformers(served_model: str, oai: openai.OpenAI, hf) -> None:
    inputs = ["The quick brown fox", "jumps over the lazy dog, again and again"]
    reply = oai.embeddings.create(model=served_model, input=inputs)  # the client asks for base64
    assert reply.model == served_model and [d.index for d in reply.data] == [0, 1]
    total = 0
    for text, item in zip(inputs, reply.data, strict=True):
        ids, hidden = hf(text)
        total += len(ids)
        torch.testing.assert_close(torch.tensor(item.embedding), normalized(hidden), atol=1e-5, rtol=1e-4)
    assert (reply.usage.prompt_tokens, reply.usage.total_tokens) == (total, total)
    one = oai.embeddings.create(model=served_model, input=[1, 450, 7483])  # one prompt of token ids
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), normalized(hf([1, 450, 7483])[1]),
                               atol=1e-5, rtol=1e-4)
    cut = oai.embeddings.create(model=served_model, input=[1, 450, 7483], extra_body={"truncate_prompt_tokens": 2})
    assert cut.usage.prompt_tokens == 2
    torch.testing.assert_close(torch.tensor(cut.data[0].embedding), normalized(hf([450, 7483])[1]), atol=1e-5, rtol=1e-4)


def test_a_conversation_is_embedded_as_its_chat_template_renders_it(
    served_model: str, http: httpx.Client, hf, tiny_llama_dir: Path
) -> None:
    """vLLM's chat form: `messages` instead of `input`, rendered without the generation
    prompt unless asked."""
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Embed this chat."}]
    template = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for add in (False, True):
        reply = http.post("/v1/embeddings", json={"model": served_model, "messages": messages,
                                                   "add_generation_prompt": add}).json()
        ids = template.apply_chat_template(messages, add_generation_prompt=add, tokenize=True, return_dict=False)
        assert reply["usage"]["prompt_tokens"] == len(ids)
        torch.testing.assert_close(torch.tensor(reply["data"][0]["embedding"]), normalized(hf(list(ids))[1]),
                                   atol=1e-5, rtol=1e-4)
    both = http.post("/v1/embeddings", json={"input": "x", "messages": messages})
    assert both.status_code == 400 and both.json()["error"]["param"] == "messages"


def test_float_and_base64_agree(served_model: str, http: httpx.Client, hf) -> None:
    body = {"model": served_model, "input": ["Hi", "Hello there"]}
    floats = http.post("/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    packed = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], packed["data"], strict=True):
        raw = base64.b64decode(b["embedding"])
        # float32, little-endian; two requests may share steps with different others: rounding
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(f["embedding"], abs=1e-5)
    raw = http.post("/v1/embeddings", json={"input": "Hello there", "normalize": False}).json()
    vector = torch.tensor(raw["data"][0]["embedding"])
    assert raw["model"] == served_model and abs(vector.norm().item() - 1.0) > 1e-3
    torch.testing.assert_close(vector, hf("Hello there")[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["fine", [1, -2]]}, 400, "input"),
        ({"input": "x", "dimensions": 0}, 400, "dimensions"),
        ({"input": "x", "dimensions": 8}, 400, None),  # the tiny Llama declares no Matryoshka sizes: the worker says so
        ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "model": "no-such-model"}, 404, "model"),
        ({"input": [99999]}, 400, None),  # outside the vocabulary: the worker says so
    ],
)
def test_bad_embedding_requests(http: httpx.Client, body: dict, status: int, param: str | None) -> None:
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_job_endpoints_show_an_embedding_job(live_worker: str, http: httpx.Client, hf) -> None:
    """An embedding job submitted with the Python client: polled and followed over HTTP."""
    import json

    from producer.client import Client
    from producer.pooling_params import PoolingParams

    with Client(live_worker) as client:
        result = client.submit("Poll me", pooling_params=PoolingParams()).result(60)
    torch.testing.assert_close(torch.tensor(result.embedding), normalized(hf("Poll me")[1]), atol=1e-5, rtol=1e-4)
    view = http.get(f"/v1/jobs/{result.id}").json()
    assert view["status"] == "finished" and view["embedding"] == result.embedding
    lines = http.get(f"/v1/jobs/{result.id}/events").text.splitlines()
    [event] = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    assert event["embedding"] == result.embedding and event["finished"]


def cosine(a: str, b: str, hf) -> float:
    return torch.nn.functional.cosine_similarity(hf(a)[1], hf(b)[1], dim=0).item()


def test_score_and_rerank_are_cosine_similarities_of_embeddings(served_model: str, http: httpx.Client, hf) -> None:
    """vLLM's /score and /rerank for an embedding model: each text embedded once, a pair
    scored by the cosine of its vectors (the oracle: transformers' hidden states)."""
    query, docs = "Where is Paris?", ["Paris is in France.", "Bananas are yellow.", "France has many cities."]
    one_to_many = http.post("/score", json={"model": served_model, "text_1": query, "text_2": docs}).json()
    assert one_to_many["object"] == "list" and [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    for doc, item in zip(docs, one_to_many["data"], strict=True):
        assert item["score"] == pytest.approx(cosine(query, doc, hf), abs=1e-5)
    assert one_to_many["usage"]["prompt_tokens"] == sum(len(hf(t)[0]) for t in [query, *docs])
    pairs = http.post("/v1/score", json={"text_1": docs[:2], "text_2": [query, docs[2]]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(
        [cosine(docs[0], query, hf), cosine(docs[1], docs[2], hf)], abs=1e-5)

    ranked = http.post("/v1/rerank", json={"model": served_model, "query": query, "documents": docs, "top_n": 2}).json()
    expected = sorted(range(3), key=lambda i: -cosine(query, docs[i], hf))[:2]
    assert [r["index"] for r in ranked["results"]] == expected
    assert [r["document"]["text"] for r in ranked["results"]] == [docs[i] for i in expected]
    assert ranked["results"][0]["relevance_score"] == pytest.approx(cosine(query, docs[expected[0]], hf), abs=1e-5)
    bare = http.post("/v2/rerank", json={"query": query, "documents": docs, "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    for path, body, param in (
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/score", {"text_1": "a", "text_2": ["c", ""]}, "text_2"),
        ("/rerank", {"query": "q", "documents": []}, "documents"),
        ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ):
        response = http.post(path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_classify_needs_a_classification_model(http: httpx.Client) -> None:
    """The tiny Llama has an LM head, not a score head: its workers publish no labels."""
    response = http.post("/classify", json={"input": "Is this positive?"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "model"
    assert "has no classification head" in response.json()["error"]["message"]
