"""KV connectors: move KV cache blocks between the engine and stores or other instances (base.py: the API)."""
