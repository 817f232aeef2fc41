"""Where a stream's slow inter-token gaps come from: the per-step trace (producer.trace_log) of a
worker and an API, joined with what a client saw. Plain Python, no torch: benchmarks/itl_trace.py
runs the load; this reads and attributes.

A client's gap between two text chunks of one request ends at the chunk written for some event
(the k-th relay line with text of the job is the k-th chunk with text). That event carries the
end time of the step that made its newest token; between it and the event before lie the engine's
steps, the publish and the relay. Each part is measured against its typical (median) value over
the whole run, and a tail gap's cause is the part that exceeds its typical value most:

- "long step": the step that made the token took longer than the median step (its prefill tokens
  and decodes are kept, to tell a prefill chunk from a large batch);
- "between steps": the engine thread was out of a step (taking commands, idle) within the gap;
- "other steps": steps that made no token for this request ran in between (it waited, was
  preempted, or its token was coalesced into the next event);
- "publish delay": from the step's end to the Redis call that published it (the worker's event
  loop busy, or an earlier call still in flight);
- "relay delay": from that call to the API's write of the chunk to the client (Redis delivers
  the event during the call, so the write may come before the call returns);
- "client": from the write to the client's read;
- "gc": garbage collections (any process traced) overlapped the gap by at least half its largest
  excess: they are then what made that part slow.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

CAUSES = ("long step", "between steps", "other steps", "publish delay", "relay delay", "client", "gc")
GC_SHARE = 0.5  # a gap is a gc pause's where collections overlapped it by this share of its largest excess
TIME_MATCH_S = 1e-6  # an event's step time is the step result's time exactly (the same float)


@dataclass
class Trace:
    """Every line of the traced processes, by kind."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    publishes: list[dict[str, Any]] = field(default_factory=list)
    relays: list[dict[str, Any]] = field(default_factory=list)
    gcs: list[dict[str, Any]] = field(default_factory=list)


def read_trace(directory: str | Path) -> Trace:
    """The lines of every `*.jsonl` in `directory`, sorted by time within each kind."""
    trace = Trace()
    by_kind = {"step": trace.steps, "publish": trace.publishes, "publish_held": trace.publishes,
               "relay": trace.relays, "gc": trace.gcs}
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                by_kind.get(entry["kind"], []).append(entry)
    trace.steps.sort(key=lambda s: s["end"])
    trace.publishes.sort(key=lambda p: p["done"])
    trace.relays.sort(key=lambda r: r["written"])
    trace.gcs.sort(key=lambda g: g["start"])
    return trace


@dataclass
class Gap:
    """One client-side gap above the threshold, with its parts' excess over their typical values."""

    job: str
    ms: float
    cause: str
    excess_ms: dict[str, float]
    step: dict[str, Any] | None = None  # the step that made the token after the gap


@dataclass
class Typical:
    """Median value of each part over the run (ms)."""

    step_ms: float
    publish_ms: float
    relay_ms: float
    client_ms: float


class _Index:
    """Look-ups over a trace: the step that ended at or before a time, the publish that carried
    a step result, the gc time within a window."""

    def __init__(self, trace: Trace) -> None:
        self.steps = trace.steps
        self.step_ends = [s["end"] for s in trace.steps]
        self.publish_of: dict[float, dict[str, Any]] = {}
        for publish in trace.publishes:
            for t in publish["steps"]:
                self.publish_of.setdefault(round(t, 6), publish)
        self.gcs = trace.gcs

    def step_before(self, t: float) -> int | None:
        i = bisect.bisect_right(self.step_ends, t + TIME_MATCH_S) - 1
        return i if i >= 0 else None

    def publish(self, step_time: float) -> dict[str, Any] | None:
        return self.publish_of.get(round(step_time, 6))

    def gc_ms(self, start: float, end: float) -> float:
        return sum(max(0.0, min(end, g["end"]) - max(start, g["start"])) * 1000 for g in self.gcs)


def client_gaps(requests: list[dict[str, Any]]) -> list[float]:
    """Every inter-chunk gap (s) of the requests' chunk times, as `genq bench serve` counts ITL."""
    return [b - a for r in requests for a, b in zip(r["chunks"], r["chunks"][1:], strict=False)]


def attribute(requests: list[dict[str, Any]], trace: Trace, threshold_s: float) -> tuple[list[Gap], Typical]:
    """The gaps above `threshold_s` of `requests` ({"job": id, "chunks": [unix times of text
    chunks]}), each with its cause; and the typical parts they are measured against."""
    index = _Index(trace)
    relays: dict[str, list[dict[str, Any]]] = {}
    for relay in trace.relays:
        if relay["text"]:
            relays.setdefault(relay["job"], []).append(relay)
    typical = _typical(requests, trace, relays, index)
    gaps = []
    for request in requests:
        lines, chunks = relays.get(request["job"], []), request["chunks"]
        if len(lines) != len(chunks):  # (not this API's stream, or traced in part): nothing to join
            continue
        for k in range(1, len(chunks)):
            if chunks[k] - chunks[k - 1] > threshold_s:
                gap = _attribute_one(request["job"], chunks[k - 1], chunks[k], lines[k - 1], lines[k], index, typical)
                if gap is not None:
                    gaps.append(gap)
    return gaps, typical


def _typical(requests: list[dict[str, Any]], trace: Trace, relays: dict[str, list[dict[str, Any]]],
             index: _Index) -> Typical:
    relay_ms, client_ms = [], []
    publish_ms: list[float] = []
    for request in requests:
        lines = relays.get(request["job"], [])
        if len(lines) != len(request["chunks"]):
            continue
        for line, chunk in zip(lines, request["chunks"], strict=True):
            publish = index.publish(line["step_time"]) if line["step_time"] is not None else None
            if publish is not None:
                publish_ms.append((publish["called"] - line["step_time"]) * 1000)
                relay_ms.append((line["written"] - publish["called"]) * 1000)
            client_ms.append((chunk - line["written"]) * 1000)
    return Typical(
        step_ms=_median([s["ms"] for s in trace.steps]),
        publish_ms=_median(publish_ms),
        relay_ms=_median(relay_ms),
        client_ms=_median(client_ms),
    )


def _attribute_one(job: str, before: float, after: float, line_before: dict[str, Any], line: dict[str, Any],
                   index: _Index, typical: Typical) -> Gap | None:
    """The parts of one gap (client chunk times `before`, `after`; their relay lines)."""
    t_before, t_after = line_before["step_time"], line["step_time"]
    if t_before is None or t_after is None:
        return None
    last = index.step_before(t_after)
    first = index.step_before(t_before)
    between = index.steps[(first + 1 if first is not None else 0):(last + 1 if last is not None else 0)]
    step = index.steps[last] if last is not None else None
    steps_ms = sum(s["ms"] for s in between)
    excess = {cause: 0.0 for cause in CAUSES}
    if step is not None:
        excess["long step"] = step["ms"] - typical.step_ms
        excess["other steps"] = steps_ms - step["ms"]
    excess["between steps"] = max(0.0, (t_after - t_before) * 1000 - steps_ms)
    publish = index.publish(t_after)
    if publish is not None:
        excess["publish delay"] = (publish["called"] - t_after) * 1000 - typical.publish_ms
        excess["relay delay"] = (line["written"] - publish["called"]) * 1000 - typical.relay_ms
    excess["client"] = (after - line["written"]) * 1000 - typical.client_ms
    excess["gc"] = index.gc_ms(before, after)
    top = max(CAUSES[:-1], key=lambda c: excess[c])
    # (a collection shows as another part's excess: a long step, a late relay; it is their cause)
    cause = "gc" if excess["gc"] >= GC_SHARE * excess[top] else top
    return Gap(job, round((after - before) * 1000, 3), cause, {c: round(v, 3) for c, v in excess.items()}, step)


def cause_shares(gaps: list[Gap]) -> dict[str, float]:
    """The share of the gaps per cause (every cause listed, 0 where none)."""
    counts = Counter(g.cause for g in gaps)
    return {cause: counts[cause] / len(gaps) if gaps else 0.0 for cause in CAUSES}


def _median(values: list[float]) -> float:
    return median(values) if values else 0.0
