"""The engine core, plain Python where it can be (vLLM's v1/core and v1/engine): request state
(`request`), the KV-cache block manager with prefix caching (`block_manager`), the scheduler,
the `Engine` that steps them (`engine`), the inputs it takes (`multimodal`, `prompt_embeds`),
and what it returns (`output_processor`, `detokenizer`, `outputs`)."""
