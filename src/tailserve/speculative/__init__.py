"""Lossless speculative decoding: proposers, the rejection sampler, adaptive k, statistics."""
