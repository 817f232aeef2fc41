"""`python -m kernels.cpu`: build genq's compiled CPU kernels now (the set-up runs it, so a
first worker never waits on the compiler). It says what it built and always exits 0: without
a compiler the torch attention path serves."""

import logging
import sys
import time

from kernels.cpu import load

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    ok = load(verbose="-v" in sys.argv[1:])
    took_s = time.perf_counter() - started
    print(f"genq_cpu: {'ready' if ok else 'not built (the torch attention path serves)'} ({took_s:.1f} s)")
