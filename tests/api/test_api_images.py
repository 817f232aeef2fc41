"""Images in chat messages through a live worker serving the tiny Mistral 3, driven by the
official `openai` client: as data URLs and as http URLs the API fetches (from a server on
loopback), in chat and in the Responses API. The oracle is the offline engine given the same
image (checked against transformers in tests/worker/test_images.py)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from api.settings import Settings
from worker import LLM, SamplingParams

IMAGE = Image.fromarray(np.random.RandomState(7).randint(0, 255, (48, 40, 3), dtype=np.uint8))
PNG = io.BytesIO()
IMAGE.save(PNG, format="PNG")
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG.getvalue()).decode()
GREEDY = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def live_worker(stack_redis, tiny_mistral3_dir: Path, run_worker, tmp_path_factory) -> Iterator[str]:
    with run_worker(stack_redis.url, tiny_mistral3_dir, tmp_path_factory.mktemp("mistral3-worker")) as url:
        yield url


@pytest.fixture(scope="module")
def image_server(serve_files) -> Iterator[str]:
    """Serves the image at /image.png."""
    with serve_files({"/image.png": (PNG.getvalue(), "image/png")}) as url:
        yield url


@pytest.fixture(scope="module")
def offline(tiny_mistral3_dir: Path):
    """The offline engine's greedy reply to the question with the image."""
    llm = LLM(str(tiny_mistral3_dir), dtype="float32", num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return llm.chat(_messages(DATA_URL), params, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def expected(offline) -> str:
    return offline.outputs[0].text


def _messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture? "},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_chat_with_an_image_as_a_data_url_whole_and_streamed(oai: openai.OpenAI, served_model: str,
                                                              expected: str, offline) -> None:
    reply = oai.chat.completions.create(model=served_model, messages=_messages(DATA_URL), **GREEDY)
    assert reply.choices[0].message.content == expected
    # the image's tokens count: 3 x 3 merged patches (40 columns round up to 48) and 3 row ends
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert offline.prompt_token_ids.count(10) == 9
    chunks = oai.chat.completions.create(model=served_model, messages=_messages(DATA_URL), stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_an_http_image_url_is_fetched_by_the_api(oai: openai.OpenAI, served_model: str, expected: str,
                                                 image_server: str) -> None:
    reply = oai.chat.completions.create(model=served_model, messages=_messages(f"{image_server}/image.png"), **GREEDY)
    assert reply.choices[0].message.content == expected
    with pytest.raises(openai.BadRequestError, match="answered 404") as info:
        oai.chat.completions.create(model=served_model, messages=_messages(f"{image_server}/missing.png"), **GREEDY)
    assert info.value.body["param"] == "messages[0].content[1].image_url"


def test_the_responses_api_takes_input_images(oai: openai.OpenAI, served_model: str, expected: str) -> None:
    content = [{"type": "input_text", "text": "What is in this picture? "}, {"type": "input_image", "image_url": DATA_URL}]
    response = oai.responses.create(model=served_model, input=[{"role": "user", "content": content}],
                                    max_output_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    assert response.output_text == expected


@pytest.mark.parametrize(("url", "error", "param"), [
    ("data:image/png;base64,@@@", "not valid base64", "messages[0].content[1].image_url"),
    ("ftp://example.com/x.png", "must be a base64 data URL", "messages[0].content[1].image_url"),
    ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "not an image PIL can read", None),
])
def test_bad_images_are_a_400_naming_them(oai: openai.OpenAI, served_model: str, url: str, error: str,
                                          param: str | None) -> None:
    with pytest.raises(openai.BadRequestError, match=error) as info:
        oai.chat.completions.create(model=served_model, messages=_messages(url), **GREEDY)
    assert info.value.body["param"] == param


def test_fetching_can_be_turned_off_and_images_capped(live_worker: str, serve_api, served_model: str,
                                                      image_server: str) -> None:
    with serve_api(Settings(redis_url=live_worker, fetch_image_urls=False, max_images_per_request=1)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="GENQ_FETCH_IMAGE_URLS=false"):
            client.chat.completions.create(model=served_model, messages=_messages(f"{image_server}/image.png"),
                                           **GREEDY)
        two = _messages(DATA_URL)
        two[0]["content"].append(two[0]["content"][1])
        with pytest.raises(openai.BadRequestError, match="hold 2 images or clips, more than this server takes") as info:
            client.chat.completions.create(model=served_model, messages=two, **GREEDY)
        assert info.value.body["param"] == "messages"
        client.close()


def test_beam_search_over_images_is_refused(oai: openai.OpenAI, served_model: str, image_server: str) -> None:
    """Refused before any image is fetched: the URL here would answer 404."""
    with pytest.raises(openai.BadRequestError, match="beam search over messages with images") as info:
        oai.chat.completions.create(model=served_model, messages=_messages(f"{image_server}/missing.png"), n=2,
                                    max_tokens=4, extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "use_beam_search"


def test_a_batch_line_takes_data_urls_only() -> None:
    """Batch lines are planned without fetching: an http URL there is a 400 saying so."""
    from api.chat import chat_prompt
    from api.errors import APIError
    from api.request_bodies import ChatCompletionRequest

    assert chat_prompt(ChatCompletionRequest(model="m", messages=_messages(DATA_URL)))[0]["content"][1]["image"] == PNG.getvalue()
    with pytest.raises(APIError, match="fetched for chat and Responses requests only") as info:
        chat_prompt(ChatCompletionRequest(model="m", messages=_messages("http://127.0.0.1:9/x.png")))
    assert info.value.param == "messages[0].content[1].image_url"
