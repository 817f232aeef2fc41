"""The batch API against the same requests sent directly, on a running stack (`genq up`):
N chat requests as one batch (upload, create, poll, read the output file), then the same N
sent at once through /v1/chat/completions. Greedy, so both give the same text.

    python benchmarks/batch.py [--base-url http://127.0.0.1:8000/v1] [--requests 64] [--max-tokens 64]

Prints both wall times, their ratio, and how many outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai

TOPICS = ["a cat", "a city", "a book", "a car", "a planet", "a song", "a river", "a chair"]
TERMINAL = ("completed", "failed", "cancelled", "expired")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    bodies = [
        {"model": model, "max_tokens": args.max_tokens, "temperature": 0.0,
         "messages": [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} in two sentences."}]}
        for i in range(args.requests)
    ]
    lines = "".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}) + "\n"
        for i, b in enumerate(bodies)
    )
    start = time.perf_counter()
    uploaded = client.files.create(file=("requests.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    while (batch := client.batches.retrieve(batch.id)).status not in TERMINAL:
        time.sleep(0.1)
    batch_s = time.perf_counter() - start
    assert batch.output_file_id is not None, batch
    outputs = {(o := json.loads(line))["custom_id"]: o for line in client.files.content(batch.output_file_id).text.splitlines()}
    start = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        direct = list(pool.map(lambda body: client.chat.completions.create(**body), bodies))
    direct_s = time.perf_counter() - start
    same = sum(
        outputs[f"r{i}"]["response"]["body"]["choices"][0]["message"]["content"] == d.choices[0].message.content
        for i, d in enumerate(direct)
    )
    print(f"batch ({batch.status}, {batch.request_counts.completed}/{len(bodies)}): {batch_s:.1f} s; "
          f"direct, {len(bodies)} at once: {direct_s:.1f} s; ratio {batch_s / direct_s:.2f}; "
          f"identical outputs {same}/{len(bodies)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
