"""Using a model: the KV-cache generator, continuous batching, and the OpenAI-compatible server."""
