"""genq's HTTP layer: OpenAI-compatible endpoints and job endpoints that relay Redis.

Thin by design: it validates requests, enqueues jobs through `producer`, and relays the events
workers write. It never imports torch or `worker`.

Layout: `routes/` holds one router per resource, each a thin handler that calls a service;
only `main` (the app) imports a route. The services sit at this package's top level (`chat`,
`completions`, `pooling`, `generate`, `batches`, `responses_api`, `messages_api`, ...), with
what they share (`deps`, `errors`, `settings`, `relay`, `render`, `request_bodies`,
`response_bodies`). `parsers/` reads a model's reply (tool calls, reasoning, harmony);
`cli/` holds the `genq` subcommands of the API side. tests/api/test_api_layout.py keeps
these rules.
"""
