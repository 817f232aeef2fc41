"""Child processes that do not outlive the command that started them (`genq redis`, `genq up`,
the test Redis).

Two halves. `stop_signals_interrupt()`: SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C
does, so the command's own cleanup stops its children in order. `die_with_parent()`: a Popen
`preexec_fn` with which, on Linux, the kernel sends the child SIGTERM when its parent dies, so a
`kill -9` of the command, which runs no cleanup at all, leaves no server behind either.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # SIGINT raises KeyboardInterrupt already
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for Popen: the child gets `signum` when this process dies. None where it
    cannot work: off Linux, and off the main thread, because the kernel sends it when the
    *thread* that forked ends, which for any other thread can be long before the process."""
    if threading.current_thread() is not threading.main_thread():
        return None
    prctl = _prctl()
    if prctl is None:
        return None
    parent_pid = os.getpid()

    def preexec() -> None:  # in the child, between fork and exec: two system calls, nothing more
        if prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0 and os.getppid() != parent_pid:
            os._exit(1)  # the parent died before the request was made: nobody to serve

    return preexec


@functools.cache
def _prctl() -> Any:
    """libc's prctl, looked up once in the parent (a dlopen after fork could deadlock)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """Inside: SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, as Ctrl-C does,
    unless this process was started with one ignored."""
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:  # `nohup genq redis` ignores SIGHUP, and keeps on
            signal.signal(signum, _raise_interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def stop_signals_ignored() -> Iterator[None]:
    """Inside: SIGINT, SIGTERM and SIGHUP are ignored, so a second one (an impatient Ctrl-C, a
    service manager's repeated SIGTERM) cannot cut the children's cleanup short."""
    signums = (signal.SIGINT, *STOP_SIGNALS)
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
