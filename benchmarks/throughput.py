"""W1 offline throughput: the engine (and, with the queue, the whole path) against transformers'
`generate`, measured in the same run. Same as `genq bench throughput`:

    python benchmarks/throughput.py [--modes engine,queue,hf] [--dtype bfloat16] [--json out.json]
"""

from __future__ import annotations

import sys

from producer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
