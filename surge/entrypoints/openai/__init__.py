"""The OpenAI-compatible HTTP server: Completions, Chat Completions and Responses over one AsyncLLM."""
