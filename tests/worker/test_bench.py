"""The benchmark code paths on a tiny model with a handful of requests: shape and arithmetic of
the report, not speed."""

from __future__ import annotations

import json

import pytest

from producer.cli import main
from worker.benchmarks.floor import FloorShape, workload_flops, workload_kv_bytes
from worker.benchmarks.workload import W1, RandomWorkload, load_dataset
from worker.model_executor.model_loader import read_config
from worker.model_executor.models.config import ModelConfig


def test_w1_is_the_issue_workload():
    reqs = W1.requests()
    assert len(reqs) == 128
    assert all(32 <= len(ids) <= 256 and 16 <= n <= 256 for ids, n in reqs)
    assert reqs == RandomWorkload().requests()  # seeded: the same in every mode and run
    assert min(min(ids) for ids, _ in reqs) >= 3


def test_floor_flops_of_the_tiny_llama_by_hand(tiny_llama_dir):
    """hidden 64, MLP 128, 2 layers, 4 heads and 2 KV heads of 16, vocab 49152. A (3, 2) request
    runs 4 tokens through the layers (the last output is not fed back), the LM head twice."""
    from transformers import AutoModelForCausalLM

    shape = FloorShape.from_model_config(ModelConfig.from_hf(read_config(tiny_llama_dir)))
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o; gate, up, down
    assert shape.params_per_token == per_layer == 36864
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)  # the checkpoint's own projections
    linear = sum(m.weight.numel() for name, m in hf.named_modules()
                 if name.startswith("model.layers.") and type(m).__name__ == "Linear")
    assert linear == 2 * per_layer
    flops = workload_flops(shape, [(3, 2)])
    assert flops["matmul"] == 2 * linear * 4
    assert flops["lm_head"] == 2 * 49152 * 64 * 2
    assert flops["attention"] == 2 * 2 * 4 * 16 * 2 * (1 + 2 + 3 + 4)  # QK and PV, 4 heads, 2 layers
    assert flops["total"] == flops["matmul"] + flops["lm_head"] + flops["attention"]
    assert workload_flops(shape, [(3, 2), (5, 1)])["total"] == flops["total"] + workload_flops(shape, [(5, 1)])["total"]
    # K/V reads: the prompt's 3 keys once, then the decode feeding position 3 reads 4 keys; K and
    # V of 2 KV heads of 16 in 2 layers, bf16
    assert workload_kv_bytes(shape, [(3, 2)], 2) == (3 + 4) * 2 * 2 * 16 * 2 * 2
    assert workload_kv_bytes(shape, [(3, 1)], 4) == 3 * 2 * 2 * 16 * 4 * 2  # no decode step at all


def test_throughput_engine_and_hf_report(tiny_llama_dir, tmp_path, capsys):
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
    floor = report["floor"]  # the workload's FLOPs at the GEMM rate measured in the run
    shape = FloorShape.from_model_config(ModelConfig.from_hf(read_config(tiny_llama_dir)))
    assert floor["flops"] == workload_flops(shape, [(len(ids), n) for ids, n in workload.requests()])
    assert floor["flops_per_s"] > 0 and "float32" in floor["gemm"]
    assert floor["floor_s"] == pytest.approx(floor["flops"]["total"] / floor["flops_per_s"], rel=1e-3, abs=1e-4)
    assert floor["kv_bytes"] == workload_kv_bytes(shape, [(len(ids), n) for ids, n in workload.requests()], 4)
    assert floor["read_bytes_per_s"] > 0 and floor["memory_floor_s"] >= floor["floor_s"] - 1e-4  # (a tighter floor)
    for r in report["results"].values():
        assert r["share_of_floor"] == pytest.approx(floor["floor_s"] / r["elapsed_s"], rel=0.02, abs=1e-3)
        assert r["share_of_memory_floor"] == pytest.approx(floor["memory_floor_s"] / r["elapsed_s"], rel=0.02, abs=1e-3)
    table = capsys.readouterr().out
    assert "compute floor:" in table and "memory-aware floor:" in table and "of mem floor" in table
    assert any(line.startswith("floor ") for line in table.splitlines())


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
