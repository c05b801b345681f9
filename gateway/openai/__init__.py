"""OpenAI-compatible chat completions with speech (docs/protocol.md, Chat request): validation, media,
route."""
