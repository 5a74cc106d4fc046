"""OpenAI-compatible HTTP serving: ``chunkserve serve``."""
