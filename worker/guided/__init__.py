"""Guided decoding (vLLM's v1/structured_output): token masks that keep a request's output in
a JSON schema, regular expression, grammar or structural tag, built on the compilers in
producer/."""
