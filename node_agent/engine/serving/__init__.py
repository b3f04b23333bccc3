"""Serving: the scheduler, the paged KV cache, and the sampler."""
