"""Structured output: grammars compiled through a grammar library, one matcher per request, token bitmasks.

The engine core advances each constrained request's matcher with its accepted tokens and fills the bitmask of the
next step on the CPU while the device runs the current one; the worker applies it to the logits before sampling.
"""
