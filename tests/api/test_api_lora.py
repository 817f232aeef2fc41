"""LoRA adapters through the OpenAI-compatible API, as vLLM serves them: each adapter is a
model of its own in /v1/models (its `parent` the base model) and in a request's `model`.
A live stack whose worker serves two adapters; outputs match the offline engine's."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from api.settings import Settings
from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams

GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def live_worker(stack_redis: RedisServer, tiny_llama_dir: Path, tiny_llama_adapters: dict[str, Path],
                run_worker, tmp_path_factory) -> Iterator[str]:
    """The module's worker, serving adapters `all` and `qv` beside the tiny Llama."""
    args = ("--lora-modules", f"all={tiny_llama_adapters['all']}", f"qv={tiny_llama_adapters['qv']}",
            "--max-loras", "2", "--max-lora-rank", "8")
    with run_worker(stack_redis.url, tiny_llama_dir, tmp_path_factory.mktemp("worker"), args) as url:
        yield url


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path, tiny_llama_adapters: dict[str, Path]):
    from worker import LLM
    from worker.core.lora_request import LoRARequest

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=256, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    requests = {"all": LoRARequest("all", 1, str(tiny_llama_adapters["all"])),
                "qv": LoRARequest("qv", 2, str(tiny_llama_adapters["qv"])), "tiny-llama": None}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def text(model: str, prompt: str | None = None) -> str:
        if prompt is None:
            return llm.chat(MESSAGES, params, use_tqdm=False, lora_request=requests[model])[0].outputs[0].text
        return llm.generate(prompt, params, use_tqdm=False, lora_request=requests[model])[0].outputs[0].text

    return text


def test_models_lists_adapters_with_their_parent(served_model: str, oai: openai.OpenAI) -> None:
    cards = {m.id: m for m in oai.models.list()}
    assert list(cards) == [served_model, "all", "qv"]
    assert [getattr(cards[m], "parent", None) for m in cards] == [None, served_model, served_model]
    card = oai.models.retrieve("qv")
    assert (card.id, card.parent, card.max_model_len) == ("qv", served_model, 1024)


@pytest.mark.parametrize("model", ["tiny-llama", "all", "qv"])
def test_completions_and_chat_run_with_the_named_adapter(model: str, oai: openai.OpenAI, offline) -> None:
    prompt = "The capital of France is"
    completion = oai.completions.create(model=model, prompt=prompt, **GREEDY)
    assert (completion.model, completion.choices[0].text) == (model, offline(model, prompt))
    chunks = list(oai.chat.completions.create(model=model, messages=MESSAGES, stream=True, **GREEDY))
    assert {c.model for c in chunks} == {model}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline(model)


def test_an_adapter_tokenizes_as_its_base_model(http, served_model: str) -> None:
    body = {"prompt": "The capital of France is"}
    base = http.post("/tokenize", json={**body, "model": served_model}).json()
    assert http.post("/tokenize", json={**body, "model": "qv"}).json() == base


def test_outputs_differ_by_adapter(oai: openai.OpenAI) -> None:
    texts = {m: oai.completions.create(model=m, prompt="Once upon a time", **GREEDY).choices[0].text
             for m in ("tiny-llama", "all", "qv")}
    assert len(set(texts.values())) == 3


def test_an_adapter_no_worker_serves_is_404(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="sql-lora", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "model_not_found" and "all, qv" in info.value.body["message"]


def test_runtime_loading_is_off_by_default(http) -> None:
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": "/x"})
    assert response.status_code == 404


@pytest.fixture(scope="module")
def runtime_api(live_worker: str, serve_api) -> Iterator[httpx.Client]:
    """An API in front of the same worker, with GENQ_ALLOW_RUNTIME_LORA_UPDATING on."""
    settings = Settings(redis_url=live_worker, request_timeout_s=60.0, allow_runtime_lora_updating=True)
    with serve_api(settings) as url, httpx.Client(base_url=url, timeout=90.0) as client:
        yield client


def test_adapters_load_and_unload_at_run_time(runtime_api: httpx.Client, served_model: str, offline,
                                              tiny_llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    def model_ids() -> list[str]:
        return [m["id"] for m in runtime_api.get("/v1/models").json()["data"]]

    def complete(model: str) -> httpx.Response:
        return runtime_api.post("/v1/completions", json={"model": model, "prompt": "The capital of France is",
                                                          "temperature": 0, "max_tokens": 12, "ignore_eos": True})

    load = runtime_api.post("/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(tiny_llama_adapters["qv"])})
    assert (load.status_code, load.text) == (200, "Success: LoRA adapter 'rt' added successfully.")
    assert model_ids() == [served_model, "all", "qv", "rt"]
    assert runtime_api.get("/v1/models/rt").json()["parent"] == served_model
    assert complete("rt").json()["choices"][0]["text"] == offline("qv", "The capital of France is")
    for name in ("rt", "all", served_model):
        again = runtime_api.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(tmp_path)})
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]

    bad = runtime_api.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert bad.status_code == 400
    assert "cannot load LoRA adapter 'bad'" in bad.json()["error"]["message"]
    assert "not a PEFT adapter directory" in bad.json()["error"]["message"]
    assert "bad" not in model_ids()

    unload = runtime_api.post("/v1/unload_lora_adapter", json={"lora_name": "rt"})
    assert (unload.status_code, unload.text) == (200, "Success: LoRA adapter 'rt' removed successfully.")
    assert model_ids() == [served_model, "all", "qv"]
    assert complete("rt").status_code == 404
    configured = runtime_api.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
    assert configured.status_code == 400 and "given to the workers at start" in configured.json()["error"]["message"]
    unknown = runtime_api.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert unknown.status_code == 400 and "cannot be found" in unknown.json()["error"]["message"]
    bad_name = runtime_api.post("/v1/load_lora_adapter", json={"lora_name": "a,b", "lora_path": "/x"})
    assert bad_name.status_code == 400 and bad_name.json()["error"]["param"] == "lora_name"


def genq_lora(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", "lora", "--redis-url", redis_url, *args],
                          capture_output=True, text=True, timeout=120)


def test_genq_lora_manages_the_registry_from_a_shell(live_worker: str, tiny_llama_adapters: dict[str, Path],
                                                     tmp_path: Path) -> None:
    added = genq_lora(live_worker, "add", "cli", str(tiny_llama_adapters["qv"]))
    assert (added.returncode, added.stdout.strip()) == (0, "Success: LoRA adapter 'cli' added successfully."), added.stderr
    listing = genq_lora(live_worker, "ls").stdout.splitlines()
    assert f"cli\t{tiny_llama_adapters['qv']}\tserved by: api-test" in listing
    assert "all\tgiven at worker start (--lora-modules)\tserved by: api-test" in listing
    refused = genq_lora(live_worker, "add", "broken", str(tmp_path))
    assert refused.returncode == 1 and "not a PEFT adapter directory" in refused.stderr
    removed = genq_lora(live_worker, "rm", "cli")
    assert removed.returncode == 0 and "removed" in removed.stdout
    assert not any(line.startswith("cli\t") for line in genq_lora(live_worker, "ls").stdout.splitlines())
