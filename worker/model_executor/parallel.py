"""Tensor parallelism's ranks at run time (vLLM's `tensor_parallel_size`): how a model split
over several devices (`worker.model_executor.tensor_parallel` says how it splits) is run.

Rank 0 is the engine's own runner; the other ranks are processes of their own (forked by
`multiprocessing`'s forkserver, never from the engine's process), each with a runner that
executes every step rank 0 sends it over a pipe, and makes each change to the LoRA adapters
sent the same way. The ranks reduce over a process group of
their own (gloo on CPU, NCCL on CUDA), made from a TCP store on the loopback: no global
`torch.distributed` state, so one process may hold several engines.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from worker.model_executor.model_loader import read_config
from worker.model_executor.model_runner import ModelOutput, ModelRunner, resolve_device
from worker.model_executor.models.config import language_config
from worker.model_executor.tensor_parallel import TIMEOUT, TensorParallel, join_group

if TYPE_CHECKING:
    from worker.config import EngineConfig
    from worker.core.block_manager import KVSwaps
    from worker.core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The engine config a rank runs with: on CUDA, its own device (rank r on cuda:r)."""
    device = resolve_device(config.device)
    if device.type != "cuda":
        return config
    return replace(config, device=f"cuda:{rank}")


class ParallelRunner:
    """Rank 0's runner, which sends each step to the other ranks' before running it; anything
    else asked of it is its own runner's."""

    def __init__(self, config: EngineConfig, model_path: Path, hf_config: Any, max_model_len: int,
                 image_config: Any = None):
        """`image_config`: an image-text checkpoint's whole config: rank 0 alone loads its image
        encoder, whose embeddings it sends the other ranks with each step that reads them."""
        world_size = config.tensor_parallel_size
        device = resolve_device(rank_config(config, 0).device)
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs, "
                             f"this host has {torch.cuda.device_count()}")
        if device.type == "cpu" and config.num_threads is None:  # each rank on its share of the cores
            threads = max(1, torch.get_num_threads() // world_size)
            torch.set_num_threads(threads)
            config = replace(config, num_threads=threads)
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        # Never fork this process, which holds threads and maybe a CUDA context: ranks fork from
        # a server process that has imported torch and transformers once (and touched no GPU),
        # so each engine's ranks start in a second, not the several a fresh interpreter takes
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["worker.model_executor.model_runner", "transformers.activations"])
        self.pipes: list[Connection] = []
        self.processes: list[Any] = []
        config = replace(config, logits_processors=())  # (rank 0 samples; a class may not pickle)
        for rank in range(1, world_size):
            ours, theirs = context.Pipe()
            process = context.Process(target=serve_rank, name=f"genq-tp-rank{rank}", daemon=True,
                                      args=(rank, world_size, store.port, config, model_path, max_model_len, theirs))
            process.start()
            theirs.close()
            self.pipes.append(ours)
            self.processes.append(process)
        self._finalizer = weakref.finalize(self, _stop, self.pipes, self.processes)
        try:
            parallel = self._unless_a_rank_stops(lambda: join_group(0, world_size, store.port, device, store))
            self.local: ModelRunner = ModelRunner(rank_config(config, 0), model_path, hf_config, max_model_len,
                                                  image_config, parallel)
        except BaseException as exc:
            if isinstance(exc, (OSError, RuntimeError)):  # a rank failed to start (its error is in its log)
                self._raise_if_a_rank_stopped(exc)
            self.close()
            raise
        self._store = store  # the other ranks' rendezvous lives as long as the group
        # an adapter read or forgotten; a request's state given back (it ended) or rewound (guesses taken back)
        self.lora = None if self.local.lora is None else AllRanks(self.local.lora, self._send, "lora",
                                                                  frozenset({"add", "remove"}))
        self.states = None if self.local.states is None else AllRanks(self.local.states, self._send, "state",
                                                                      frozenset({"remove", "rewind"}))

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        """Run a step on every rank, with what rank 0's images bring to its rows (rank 0 alone
        encodes them). A rank that has stopped fails the step (and so the engine) by name, at
        once: the others never wait for it."""
        images = self.local.step_images(out)
        self._send(("step", out, None if images is None else _by_value(images)))
        try:
            return self.local.execute(out, images)
        except (OSError, RuntimeError) as exc:  # the group's connections closed
            self._raise_if_a_rank_stopped(exc)
            raise

    def swap_blocks(self, swaps: KVSwaps) -> None:
        """KV offloading's copies, made by every rank in its own pool and host slots."""
        self._send(("swap_blocks", swaps))
        self.local.swap_blocks(swaps)

    def reload_weights(self, source: Path | Mapping[str, torch.Tensor], image_config: Any = None) -> None:
        """New weights on every rank (ModelRunner.reload_weights: each reads its share of the
        checkpoint, and none copies unless all could)."""
        if not isinstance(source, Path):  # (Engine.reload_weights refuses them first)
            raise ValueError("tensor-parallel ranks read new weights from a checkpoint's path")
        self._send(("reload_weights", source))
        self.local.reload_weights(source, image_config)

    def sleep(self, level: int) -> None:
        """Sleep mode, on every rank (ModelRunner.sleep)."""
        self._send(("sleep", level))
        self.local.sleep(level)

    def wake_weights(self) -> None:
        self._send(("wake_weights",))
        self.local.wake_weights()

    def wake_cache(self) -> None:
        self._send(("wake_cache",))
        self.local.wake_cache()

    def _send(self, message: Any) -> None:
        """Send every other rank a step, or a change to its adapters; a rank that has stopped
        is named."""
        try:
            for pipe in self.pipes:
                pipe.send(message)
        except OSError as exc:  # its pipe closed
            self._raise_if_a_rank_stopped(exc)
            raise

    def _raise_if_a_rank_stopped(self, exc: BaseException) -> None:
        """Name the ranks that stopped, if that is what failed: a rank that crashed closes its
        connections a moment before it is gone, so each gets a few seconds to be."""
        deadline = time.monotonic() + 5.0
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0.0))
        stopped = [f"rank {rank} (exit code {p.exitcode})" for rank, p in enumerate(self.processes, 1)
                   if not p.is_alive()]
        if stopped:
            self.close()
            raise RuntimeError(f"tensor-parallel {', '.join(stopped)} stopped") from exc

    def _unless_a_rank_stops(self, join: Callable[[], TensorParallel]) -> TensorParallel:
        """`join()`, which waits for every rank to join: in a thread of its own, given up (it
        stays blocked until the store's timeout) as soon as a rank stops before joining."""
        joined: list[TensorParallel | BaseException] = []

        def run() -> None:
            try:
                joined.append(join())
            except BaseException as exc:
                joined.append(exc)

        thread = threading.Thread(target=run, name="genq-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if thread.is_alive() and not all(p.is_alive() for p in self.processes):
                raise RuntimeError("a rank stopped before it joined the group")
        if isinstance(joined[0], BaseException):
            raise joined[0]
        return joined[0]

    def close(self) -> None:
        """Stop the other ranks (also done when this runner is collected)."""
        self._finalizer()

    def __getattr__(self, name: str) -> Any:
        if name == "local":  # asked before it was made (a failed start): not a recursion
            raise AttributeError(name)
        return getattr(self.local, name)


class AllRanks:
    """Rank 0's `local` (its LoRA manager, its states of the layers with one per request),
    whose `changes`, called, are made on every rank: rank 0 makes one first (so a bad adapter
    is refused there, by name, and goes no further), then sends it to the others, which make
    it on their own (an adapter's share, their heads' states) before the next step. Anything
    else asked of it is rank 0's."""

    def __init__(self, local: Any, send: Callable[[Any], None], kind: str, changes: frozenset[str]):
        self.local = local
        self._send, self._kind, self._changes = send, kind, changes

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.local, name)
        if name not in self._changes:
            return value

        def everywhere(*args: Any) -> None:
            value(*args)
            self._send((f"{name}_{self._kind}", *args))

        return everywhere


def _by_value(obj: Any) -> bytes:
    """`obj`'s tensors and all, as bytes: sent over a pipe, tensors would go by shared memory."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _stop(pipes: list[Connection], processes: list[Any]) -> None:
    for pipe in pipes:
        try:
            pipe.send(None)
        except (BrokenPipeError, OSError):  # it has stopped already
            pass
        pipe.close()
    for process in processes:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()


def serve_rank(rank: int, world_size: int, port: int, config: EngineConfig, model_path: Path, max_model_len: int,
               pipe: Connection) -> None:
    """A rank other than 0: build its share of the model, then run each step rank 0 sends,
    until rank 0 says stop or goes away."""
    config = rank_config(config, rank)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    parallel = join_group(rank, world_size, port, resolve_device(config.device))
    hf_config = language_config(read_config(model_path, config.hf_overrides))
    runner = ModelRunner(config, model_path, hf_config, max_model_len, parallel=parallel)
    while True:
        try:
            message = pipe.recv()
        except EOFError:  # rank 0's process is gone
            return
        if message is None:
            return
        kind, *args = message
        if kind == "step":  # (the step, its image inputs as bytes)
            images = None if args[1] is None else torch.load(io.BytesIO(args[1]), weights_only=False)
            runner.execute_layers(args[0], images)
        elif kind == "swap_blocks":  # KV offloading's copies
            runner.swap_blocks(*args)
        elif kind in ("sleep", "wake_weights", "wake_cache"):  # sleep mode
            getattr(runner, kind)(*args)
        elif kind == "reload_weights":  # (a checkpoint that cannot be read leaves every rank as it was)
            try:
                runner.reload_weights(*args)
            except Exception:
                logger.exception("rank %d could not read its share of %s", rank, args[0])
        else:  # an AllRanks change: add_lora (a request), remove_lora (an id), remove_state, rewind_state (an id)
            name, _, owner = kind.rpartition("_")
            getattr(getattr(runner, {"lora": "lora", "state": "states"}[owner]), name)(*args)
