"""Guided decoding's grammars on the producer's side of the queue: only what is checked before
a job is queued. The worker compiles every guide with xgrammar (`worker.guided`), which
imports torch, so `SamplingParams` (the client and the API) checks shapes here and leaves the
grammar itself to the worker, which fails a job whose guide it cannot compile, naming why.
Structural tags (`structural_tag`) have the richest shape, checked here in full.
"""
