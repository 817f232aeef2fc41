"""`genq bench`: W1 throughput (offline engine, the queue, transformers' static batching) and
serving load over HTTP. A user command, so it ships in the package; the rest of the
benchmarks, run from a checkout, are in benchmarks/."""
