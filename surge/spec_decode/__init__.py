"""Speculative decoding: proposers of draft tokens (n-gram lookup; a draft model later) that the target verifies."""
