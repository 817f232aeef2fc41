"""Speculative decoding (vLLM's v1/spec_decode): its configuration, pacing and n-gram proposer
(`speculative`), and the proposers that run a model (`draft_model`: a draft model, MTP
layers, EAGLE-3 heads)."""
