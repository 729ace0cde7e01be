"""Encoder disaggregation: encoder cache (EC) connectors, which carry an image's embeddings from an encoder-only
instance to the prefill (or combined) instance that merges them, keyed by the image's content hash."""
