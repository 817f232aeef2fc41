"""Sampling (vLLM's v1/sample): the batched sampler and its per-step batch of parameters,
logits processors, and the thinking-token budget."""
