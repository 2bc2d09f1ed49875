"""Caches and the forward over a batch's rows: the padded per-row KV cache (`kv.py`), the forward that
feeds rows their tokens (`feeding.py`), and the cache of prompts' prefixes (`prefix.py`).

The lowest floor of the decoding stack: it imports nothing of the core. The kernels above find the
forward here and drive it (the exactness check, the compiled step); the forward finds a model's
compiled step in a registry the kernels fill, never by importing them.
"""
