"""The LoRA adapters a worker serves: those its configuration names (`--lora-modules`), and
those of the cluster's runtime registry, the hash `genq:lora_adapters` (name -> path), which
the API's /v1/load_lora_adapter writes and which the worker follows every heartbeat.

Changed only in the engine thread (reading an adapter is the engine's work); `served` and
`errors` are replaced, never mutated, so the event loop reads consistent snapshots for the
intake check and the heartbeat.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from worker.core.lora_request import LoRARequest

if TYPE_CHECKING:
    from worker.core.engine import Engine

logger = logging.getLogger(__name__)


class ServedAdapters:
    def __init__(self, configured: dict[str, LoRARequest]) -> None:
        self.configured = dict(configured)  # fixed for the worker's life
        self.served: dict[str, LoRARequest] = dict(configured)  # by the `model` name jobs use
        self.errors: dict[str, str] = {}  # registry names this worker could not load, and why
        self._failed_paths: dict[str, str] = {}  # name -> the path that failed: not retried
        self._next_id = len(configured) + 1
        self._retiring: list[int] = []  # ids no longer served, read until no request uses them

    def load_configured(self, engine: Engine) -> None:
        """Read the configured adapters; a bad one raises, which stops the worker's start."""
        for request in self.configured.values():
            engine.add_lora(request)

    def follow(self, engine: Engine, registry: dict[str, str]) -> None:
        """Serve what the registry holds now: read new adapters (a failure is noted in
        `errors`, not raised: one bad registration must not stop the worker) and stop serving
        those it dropped. A configured name shadows the registry's."""
        served = {n: r for n, r in self.served.items() if n in self.configured or registry.get(n) == r.lora_path}
        self._retiring += [r.lora_int_id for n, r in self.served.items() if n not in served]
        self._failed_paths = {n: p for n, p in self._failed_paths.items() if registry.get(n) == p}
        errors = {n: e for n, e in self.errors.items() if n in self._failed_paths}
        for name, path in registry.items():
            if name in served or name in self._failed_paths:
                continue
            request = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            try:
                engine.add_lora(request)
            except Exception as exc:  # noqa: BLE001 (a bad file of any kind must not stop the worker)
                reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                logger.warning("cannot serve LoRA adapter %r: %s", name, reason)
                self._failed_paths[name], errors[name] = path, reason
                continue
            logger.info("serving LoRA adapter %r from %s", name, path)
            served[name] = request
        self.served, self.errors = served, errors

    def retire_unused(self, engine: Engine) -> None:
        """Free adapters no longer served once no request in the engine runs with them."""
        if not self._retiring:
            return
        in_use = {r.lora_id for r in engine.scheduler.requests.values()}
        for lora_id in [i for i in self._retiring if i not in in_use]:
            engine.remove_lora(lora_id)
            self._retiring.remove(lora_id)
