"""The benchmark code paths on a tiny model with a handful of requests: shape and arithmetic of
the report, not speed."""

from __future__ import annotations

import json

from producer.cli import main
from worker.benchmarks.workload import W1, RandomWorkload, load_dataset


def test_w1_is_the_issue_workload():
    reqs = W1.requests()
    assert len(reqs) == 128
    assert all(32 <= len(ids) <= 256 and 16 <= n <= 256 for ids, n in reqs)
    assert reqs == RandomWorkload().requests()  # seeded: the same in every mode and run
    assert min(min(ids) for ids, _ in reqs) >= 3


def test_throughput_engine_and_hf_report(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--model", str(tiny_llama_dir), "--dtype", "float32",
               "--modes", "engine,hf", "--num-prompts", "5", "--input-len", "20", "--output-len", "8",
               "--range-ratio", "0.5", "--num-gpu-blocks-override", "64", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    workload = RandomWorkload.from_lengths(5, 20, 8, 0.5)
    expected_out = sum(n for _, n in workload.requests())
    expected_in = sum(len(ids) for ids, _ in workload.requests())
    assert report["workload"]["num_prompts"] == 5
    for mode in ("engine", "hf"):
        r = report["results"][mode]
        assert r["output_tokens"] == expected_out and r["input_tokens"] == expected_in
        assert r["output_tokens_per_s"] > 0 and r["num_requests"] == 5
        assert abs(r["output_tokens_per_s"] - r["output_tokens"] / r["elapsed_s"]) / r["output_tokens_per_s"] < 0.05
    assert report["results"]["hf"]["ratio_to_hf"] == 1.0


def test_throughput_with_dummy_weights_needs_no_checkpoint(shape_only, tmp_path):
    """(The engine mode also quantizes its weights and cache to fp8 here, as the flags ask.)"""
    out = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--model", str(shape_only), "--dtype", "float32",
               "--load-format", "dummy", "--modes", "engine,hf", "--num-prompts", "3",
               "--input-len", "12", "--output-len", "4", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
               "--num-gpu-blocks-override", "64", "--json", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert results["engine"]["output_tokens"] == results["hf"]["output_tokens"] == 12


def test_dataset_workload(tmp_path, tiny_llama_dir):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Hello there", "max_tokens": 4}\n\n{"prompt": "Count: 1, 2,", "max_tokens": 6}\n')
    workload = load_dataset(data)
    assert workload.prompts() == ["Hello there", "Count: 1, 2,"]
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--model", str(tiny_llama_dir), "--dtype", "float32", "--modes", "engine",
                 "--dataset", str(data), "--num-gpu-blocks-override", "64", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"]["engine"]["output_tokens"] == 10


def test_throughput_queue_mode_matches_engine_counts(tiny_llama_dir, tmp_path, redis_url):
    out = tmp_path / "queue.json"
    rc = main(["bench", "throughput", "--model", str(tiny_llama_dir), "--dtype", "float32",
               "--modes", "engine,queue", "--num-prompts", "4", "--input-len", "16", "--output-len", "6",
               "--range-ratio", "0.5", "--redis-url", redis_url, "--num-gpu-blocks-override", "64", "--json", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert results["queue"]["output_tokens"] == results["engine"]["output_tokens"]
    assert results["queue"]["input_tokens"] == results["engine"]["input_tokens"]
    assert "ratio_to_engine" in results["queue"]
