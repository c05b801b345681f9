"""OpenAI-compatible chat completions with speech (wire-protocol §2): validation, media, route."""
