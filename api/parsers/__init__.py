"""Readers of a model's reply text, as vLLM's `--tool-call-parser` and `--reasoning-parser`
read it: the tool-call formats (hermes in tool_calls, which also picks the reader for
GENQ_TOOL_CALL_PARSER; GLM's, pythonic, the special-token sections, Llama 3 / Mistral /
Granite JSON), reasoning split from the answer, gpt-oss's harmony, and the strict tools'
structural tags for those formats. Plain functions and small stateful readers fed a stream
piece by piece; no I/O, nothing here imports a route or a service."""
