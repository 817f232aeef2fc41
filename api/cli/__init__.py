"""The `genq` subcommands the API side owns, one module each, as producer/cli.py names them
("module:function" builders): `genq api` (serve), `genq status`, `genq usage`, `genq keys`,
`genq lora`, and `genq weights` / `sleep` / `wake` / `pause` / `resume` (fleet). Each parses
its flags and calls the same services the HTTP routes call (api.api_keys, api.usage,
api.lora_adapters, ...), so a shell and the API act alike; no route is imported here."""
