"""The per-step trace (GENQ_TRACE_DIR / `genq worker --trace-dir`): JSON lines a worker and an
API process append while they serve, to find where a stream's slow gaps come from
(benchmarks/itl_trace.py reads them).

One file per process, `<dir>/<role>-<pid>.jsonl`; each line is an object whose `kind` says what
it is: "step" (the engine thread), "publish" (the worker's publisher), "relay" (the API: one
event written to an HTTP client), "gc" (a garbage collection, in any thread). Times are unix
times in seconds, durations in ms. Off (no TraceLog) it costs one `if` where a line would be.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class TraceLog:
    """Appends JSON lines to `<directory>/<role>-<pid>.jsonl`, from any thread."""

    def __init__(self, directory: str | Path, role: str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"{role}-{os.getpid()}.jsonl"
        self._file = self.path.open("a", buffering=1)  # (a line at a time: readable while it runs)
        self._lock = threading.Lock()
        self._gc_started: dict[int, float] = {}  # thread id -> unix time its collection began

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, **fields}, separators=(",", ":"))
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def watch_gc(self) -> None:
        """Write a "gc" line for every collection from now on (gc.callbacks)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        thread = threading.get_ident()
        if phase == "start":
            self._gc_started[thread] = time.time()
            return
        start = self._gc_started.pop(thread, None)
        if start is not None:
            end = time.time()
            self.write("gc", start=start, end=end, ms=round((end - start) * 1000, 3),
                       generation=info.get("generation"), collected=info.get("collected"),
                       thread=threading.current_thread().name)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        with self._lock:
            self._file.close()


def open_trace(directory: str | None, role: str) -> TraceLog | None:
    """A TraceLog watching gc in `directory`, or None where no directory is set (tracing off)."""
    if not directory:
        return None
    trace = TraceLog(directory, role)
    trace.watch_gc()
    return trace
