"""Lossless speculative decoding: proposers (draft model, n-gram, hybrid), adaptive k, statistics.
The rejection sampler they feed lives in ``tailserve.sample.rejection``."""
