"""The engine: model runner, streams, scheduling and the offline `LLM` API."""
