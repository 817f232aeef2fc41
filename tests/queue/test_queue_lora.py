"""A worker serving LoRA adapters beside its model (`--lora-modules`): a job names an adapter
in `model`, runs with it in a batch shared with other adapters and the base model, and keeps
it when another worker resumes the job. Outputs match the offline engine with the adapter."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from queue_support import WorkerProcess, age, ended, ghost_takes, record, streamed_pieces, wait_for

from producer.client import Client
from producer.jobs import JobFailed, build_job
from producer.protocol import (
    APPEND_EVENTS_LUA,
    EVENTS_TTL_S,
    Event,
    JobStatus,
    encode_event,
    encode_job,
)
from producer.records import decode_worker_info
from producer.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.queue.config import WorkerConfig, config_from_env

NAME = "ql1"
TIMEOUT_S = 30.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def lora_oracle(tiny_llama_dir: Path, tiny_llama_adapters: dict[str, Path]):
    """`lora_oracle(prompt, params, adapter)`: the offline engine's completions with the
    adapter (None: the base model), with the ids the worker gives them."""
    import torch

    from worker import LLM
    from worker.core.lora_request import LoRARequest

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=256, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    requests = {"all": LoRARequest("all", 1, str(tiny_llama_adapters["all"])),
                "qv": LoRARequest("qv", 2, str(tiny_llama_adapters["qv"]))}

    def generate(prompt: str, params: SamplingParams, adapter: str | None):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            lora = requests[adapter] if adapter else None
            return llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].outputs
        finally:
            torch.set_num_threads(threads)

    return generate


@pytest.fixture(scope="module")
def worker(spawn: Callable[..., WorkerProcess], conn: redis.Redis,
           tiny_llama_adapters: dict[str, Path]) -> WorkerProcess:
    args = ("--lora-modules", f"all={tiny_llama_adapters['all']}", f"qv={tiny_llama_adapters['qv']}",
            "--max-loras", "2", "--max-lora-rank", "8", "--served-model-name", "tiny-llama")
    proc = spawn(NAME, via="genq", args=args)
    proc.wait_ready(conn)
    return proc


def test_jobs_run_with_the_adapter_they_name(client: Client, lora_oracle) -> None:
    prompts = ["The capital of France is", "Once upon a time"]
    cases = [(p, model) for p in prompts for model in (None, "all", "qv", "tiny-llama")]
    handles = [client.submit(p, GREEDY, model=model) for p, model in cases]
    for handle, (prompt, model) in zip(handles, cases, strict=True):
        result = handle.result(TIMEOUT_S)
        adapter = model if model in ("all", "qv") else None
        expected = lora_oracle(prompt, GREEDY, adapter)
        assert result.status == JobStatus.FINISHED
        assert [(o.text, o.token_ids) for o in result.outputs] == [(o.text, o.token_ids) for o in expected], model
    by_adapter = {model: handle.result(TIMEOUT_S).outputs[0].token_ids
                  for handle, (prompt, model) in zip(handles, cases, strict=True) if prompt == prompts[0]}
    assert len({tuple(t) for t in by_adapter.values()}) == 3  # base (twice, by both names), all, qv


def test_unknown_adapter_fails_its_job(client: Client) -> None:
    job = client.submit("hello", GREEDY, model="sql-lora")
    with pytest.raises(JobFailed, match="model 'sql-lora' is not served"):
        job.result(TIMEOUT_S)


def test_heartbeat_lists_the_adapters(client: Client, conn: redis.Redis) -> None:
    info = wait_for(lambda: conn.hgetall(client.keys.worker(NAME)), TIMEOUT_S, "a heartbeat")
    info = decode_worker_info(info, NAME)
    assert (info.model, info.lora_modules, info.adapters) == ("tiny-llama", "all,qv", ["all", "qv"])


def test_reclaimed_job_keeps_its_adapter(client: Client, conn: redis.Redis, lora_oracle, tiny_llama_dir) -> None:
    """A dead worker's job under adapter `qv`, 5 tokens in: the live worker resumes it with
    the same adapter, so the whole output is the adapter's."""
    from transformers import AutoTokenizer

    expected = lora_oracle("Resume me", GREEDY, "qv")[0]
    keys = client.keys
    job = build_job("Resume me", GREEDY, job_id="lora-resume", model="qv")
    entry_id = ghost_takes(conn, keys, encode_job(job))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    sent = expected.token_ids[:5]
    events = [encode_event(Event(seq=i, token_ids=[t], text=piece))
              for i, (t, piece) in enumerate(zip(sent, streamed_pieces(tokenizer, GREEDY, sent), strict=True))]
    conn.register_script(APPEND_EVENTS_LUA)(keys=[keys.events("lora-resume")], args=[EVENTS_TTL_S, *events])
    age(conn, keys, entry_id)
    wait_for(lambda: ended(conn, keys, "lora-resume"), TIMEOUT_S, "resumed job ended")
    result = client.result("lora-resume", TIMEOUT_S)
    assert (result.outputs[0].text, result.outputs[0].token_ids) == (expected.text, expected.token_ids)
    assert record(conn, keys, "lora-resume").worker == NAME


def test_a_bad_adapter_stops_the_worker_at_start(spawn: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    proc = spawn("ql-bad", GENQ_LORA_MODULES=f"broken={tmp_path}", GENQ_SERVED_MODEL_NAME="tiny-llama")
    assert proc.wait(60) != 0
    assert "LoRA adapter 'broken'" in proc.log() and "not a PEFT adapter directory" in proc.log()


def test_lora_settings_are_checked_where_they_are_read() -> None:
    config = config_from_env({"GENQ_LORA_MODULES": "a=/x, b=/y", "GENQ_MAX_LORAS": "2"})
    assert config.lora_modules == (("a", "/x"), ("b", "/y"))
    assert (config.engine.enable_lora, config.engine.max_loras) == (True, 2)
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in config.lora_requests.values()] == [
        ("a", 1, "/x"), ("b", 2, "/y")]
    assert config.serves("a") and config.serves(None) and not config.serves("c")
    with pytest.raises(ValueError, match="GENQ_LORA_MODULES items must be name=path, got 'b'"):
        config_from_env({"GENQ_LORA_MODULES": "a=/x,b"})
    with pytest.raises(ValueError, match="names must differ"):
        config_from_env({"GENQ_LORA_MODULES": "a=/x,a=/y"})
    with pytest.raises(ValueError, match="is the served model's own name"):
        config_from_env({"GENQ_LORA_MODULES": "SmolLM2-135M-Instruct=/x"})
    with pytest.raises(ValueError, match="enable_lora is off"):
        WorkerConfig(engine=EngineConfig(), lora_modules=(("a", "/x"),))


def adapters_become(conn: redis.Redis, keys, names: list[str]) -> dict[str, str]:
    """Wait until the worker's heartbeat lists these adapters; its load errors then."""
    def listed():
        info = decode_worker_info(conn.hgetall(keys.worker(NAME)), NAME)
        return info if info.adapters == names else None

    return wait_for(listed, TIMEOUT_S, f"the heartbeat listing adapters {names}").adapter_errors


def test_runtime_registry_adds_and_removes_adapters(client: Client, conn: redis.Redis, lora_oracle,
                                                    tiny_llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    """Adapters named in genq:lora_adapters are served from the next heartbeat on, and stop
    being served when their entry goes; one that cannot load is reported, and harms nothing."""
    keys = client.keys
    conn.hset(keys.lora_adapters, mapping={"rt": str(tiny_llama_adapters["qv"]), "broken": str(tmp_path),
                                           "all": str(tiny_llama_adapters["qv"])})  # "all" is configured
    errors = adapters_become(conn, keys, ["all", "qv", "rt"])
    assert list(errors) == ["broken"] and "not a PEFT adapter directory" in errors["broken"]
    for model, oracle_adapter in (("rt", "qv"), ("all", "all")):  # the configured "all" stays itself
        result = client.submit("The capital of France is", GREEDY, model=model).result(TIMEOUT_S)
        assert result.outputs[0].token_ids == lora_oracle("The capital of France is", GREEDY, oracle_adapter)[0].token_ids
    conn.hdel(keys.lora_adapters, "rt", "broken")
    assert adapters_become(conn, keys, ["all", "qv"]) == {}
    with pytest.raises(JobFailed, match="model 'rt' is not served .* LoRA adapters all, qv"):
        client.submit("hello", GREEDY, model="rt").result(TIMEOUT_S)
    conn.delete(keys.lora_adapters)


def test_retired_adapters_leave_the_engine_once_unused(tiny_llama_dir: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    from worker.core.engine import Engine
    from worker.queue.adapters import ServedAdapters

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64,
                                 enable_lora=True, max_lora_rank=8))
    adapters = ServedAdapters({})
    adapters.follow(engine, {"rt": str(tiny_llama_adapters["all"])})
    rt = adapters.served["rt"]
    engine.add_request("r", "hello", SamplingParams(max_tokens=2), lora_request=rt)
    engine.step()
    adapters.follow(engine, {})
    adapters.retire_unused(engine)
    assert "rt" not in adapters.served and rt.lora_int_id in engine.runner.lora.adapters  # still running
    while engine.has_unfinished_requests():
        engine.step()
    adapters.retire_unused(engine)
    assert rt.lora_int_id not in engine.runner.lora.adapters
    adapters.follow(engine, {"rt": str(tiny_llama_adapters["all"])})  # back: a new id
    assert adapters.served["rt"].lora_int_id > rt.lora_int_id


def test_a_corrupt_registry_adapter_is_reported_not_fatal(tiny_llama_dir: Path, tiny_llama_adapters: dict[str, Path],
                                                          tmp_path: Path) -> None:
    import shutil

    from worker.core.engine import Engine
    from worker.queue.adapters import ServedAdapters

    corrupt = shutil.copytree(tiny_llama_adapters["qv"], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64,
                                 enable_lora=True, max_lora_rank=8))
    adapters = ServedAdapters({})
    adapters.follow(engine, {"corrupt": str(corrupt), "fine": str(tiny_llama_adapters["qv"])})
    assert list(adapters.served) == ["fine"] and list(adapters.errors) == ["corrupt"]
    assert "cannot read its files" in adapters.errors["corrupt"]
