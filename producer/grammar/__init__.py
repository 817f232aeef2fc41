"""The languages guided decoding holds an output to, each compiled to an automaton over the
output's UTF-8 bytes: regular expressions (`regex`), EBNF and Lark grammars (`ebnf`, `lark`),
the JSON Schema subset (`json_schema`, with its string and number constraints in
`json_values`) and structural tags (`structural_tag`).

Plain Python with no dependencies, shared by both sides of the queue: `SamplingParams` (so the
client and the API) compiles a job's guide to refuse a bad one before it is queued, and the
worker's `worker.guided` runs the same automata to mask tokens. Named for what the modules
are, grammars, as vLLM's structured-output backends call theirs; `worker.guided` is the
decoding side that uses them.
"""
