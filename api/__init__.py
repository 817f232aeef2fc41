"""genq's HTTP layer: OpenAI-compatible endpoints and job endpoints that relay Redis.

Thin by design: it validates requests, enqueues jobs through `producer`, and relays the events
workers write. It never imports torch or `worker`.
"""
