"""The ITL tail's attribution (worker.benchmarks.itl_trace) on synthetic traces: one stream whose
token comes every 100 ms step, with one slow part planted per gap; each planted gap must come
out with that part as its cause, and no other gap above the threshold."""

from __future__ import annotations

from typing import Any

from worker.benchmarks.itl_trace import Trace, attribute, cause_shares, client_gaps

STEP_S = 0.1
PUBLISH_S = 0.005  # step end -> publish call made
CALL_S = 0.002  # the publish call's round trip
RELAY_S = 0.001  # publish call made -> written to the client
CLIENT_S = 0.001  # written -> read by the client
SLOW_S = 0.3


class Stream:
    """A worker, an API and a client tracing one job, a token per step."""

    def __init__(self) -> None:
        self.trace = Trace()
        self.chunks: list[float] = []
        self.now = 1000.0

    def step(self, ms: float = STEP_S * 1000, idle_s: float = 0.0, prefill: int = 0, publish_s: float = PUBLISH_S,
             relay_s: float = RELAY_S, gc_s: float = 0.0) -> None:
        start = self.now + idle_s
        end = start + ms / 1000
        self.trace.steps.append({"start": start, "end": end, "ms": ms, "decodes": 1, "prefill_tokens": prefill})
        called = end + publish_s
        self.trace.publishes.append({"steps": [end], "called": called, "done": called + CALL_S,
                                     "delay_ms": (publish_s + CALL_S) * 1000})
        written = called + relay_s
        if gc_s:  # a collection in the API, while the event waited to be written
            self.trace.gcs.append({"start": written - gc_s, "end": written, "ms": gc_s * 1000})
        self.trace.relays.append({"job": "j", "seq": len(self.chunks), "text": True, "step_time": end,
                                  "written": written})
        self.chunks.append(written + CLIENT_S)
        self.now = end

    def requests(self) -> list[dict[str, Any]]:
        return [{"job": "j", "chunks": self.chunks}]


def planted() -> tuple[Stream, dict[int, str]]:
    """A stream of 40 steps; the gaps ending at the keys' chunks slowed by the named part."""
    stream, plants = Stream(), {}
    slow: dict[int, dict[str, Any]] = {
        5: {"ms": STEP_S * 1000 + SLOW_S * 1000, "prefill": 512},
        10: {"idle_s": SLOW_S},
        15: {"publish_s": PUBLISH_S + SLOW_S},
        20: {"relay_s": RELAY_S + SLOW_S},
        25: {"relay_s": RELAY_S + SLOW_S, "gc_s": SLOW_S * 0.9},
    }
    causes = {5: "long step", 10: "between steps", 15: "publish delay", 20: "relay delay", 25: "gc"}
    for i in range(40):
        stream.step(**slow.get(i, {}))
        if i in causes:
            plants[i] = causes[i]
    return stream, plants


def test_each_planted_gap_is_put_down_to_the_part_that_was_slow() -> None:
    stream, plants = planted()
    gaps, typical = attribute(stream.requests(), stream.trace, threshold_s=2 * STEP_S)
    assert abs(typical.step_ms - STEP_S * 1000) < 1e-6 and abs(typical.publish_ms - PUBLISH_S * 1000) < 1e-6
    assert len(gaps) == len(plants), [(g.ms, g.cause) for g in gaps]
    expected = sorted(plants.values())
    assert sorted(g.cause for g in gaps) == expected
    long_step = next(g for g in gaps if g.cause == "long step")
    assert long_step.step is not None and long_step.step["prefill_tokens"] == 512
    assert abs(long_step.excess_ms["long step"] - SLOW_S * 1000) < 1e-6
    shares = cause_shares(gaps)
    assert shares["long step"] == shares["gc"] == 1 / len(plants) and shares["client"] == 0.0


def test_a_publish_that_stays_late_is_the_typical_publish_and_no_tail() -> None:
    stream = Stream()
    for _ in range(20):
        stream.step(publish_s=PUBLISH_S + SLOW_S)  # every event late alike: the gaps stay a step long
    gaps, typical = attribute(stream.requests(), stream.trace, threshold_s=2 * STEP_S)
    assert gaps == [] and abs(typical.publish_ms - (PUBLISH_S + SLOW_S) * 1000) < 1e-6
    assert all(abs(g - STEP_S) < 1e-9 for g in client_gaps(stream.requests()))


def test_a_stream_whose_chunks_the_relay_lines_do_not_match_is_left_out() -> None:
    stream, _ = planted()
    requests = [{"job": "j", "chunks": stream.chunks[:-1]}]  # a chunk the trace never wrote
    assert attribute(requests, stream.trace, threshold_s=2 * STEP_S)[0] == []
