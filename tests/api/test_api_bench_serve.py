"""`genq bench serve` against a live stack (real worker on the tiny model): the report's shape
and that its counts add up. Not a timed test."""

from __future__ import annotations

import json

from producer.cli import main


def test_bench_serve_reports_latencies(api_url, tmp_path):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", api_url, "--num-prompts", "6", "--input-words", "8",
               "--output-len", "5", "--request-rate", "inf", "--max-concurrency", "3", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["failed"] == 0 and report["completed"] == 6
    assert report["output_tokens"] == 6 * 5
    for key in ("ttft_s", "itl_s", "e2e_s"):
        p = report[key]
        # chunks that arrive in one read are microseconds apart: an inter-token latency may be ~0
        assert (0 <= p["p50"] if key == "itl_s" else 0 < p["p50"]) and p["p50"] <= p["p90"] <= p["p99"]
    assert report["ttft_s"]["p50"] <= report["e2e_s"]["p50"]


def test_bench_serve_counts_failures(tmp_path):
    out = tmp_path / "fail.json"
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2",
               "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 1 and report["failed"] == 2 and report["errors"]


def test_long_prompts_mix_in_at_their_share_and_leave_the_default_prompts_alone():
    import random

    from worker.benchmarks.serve import WORDS, make_prompts

    rng = random.Random(0)
    before = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(20)]  # the prompts of earlier runs
    assert make_prompts(random.Random(0), 20, 8) == before
    mixed = make_prompts(random.Random(0), 200, 8, long_fraction=0.25, long_words=300)
    lengths = [len(p.split()) for p in mixed]
    assert set(lengths) == {8, 300}
    assert 30 <= lengths.count(300) <= 70  # a quarter of 200, seeded
