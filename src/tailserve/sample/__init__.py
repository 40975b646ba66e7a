"""Sampling maths, a leaf package that the engine's runner and the proposers both use:
the batched sampler and its tensors (``sampler``), penalties and logit bias
(``logits_processors``), and the rejection sampler of speculative decoding (``rejection``)."""
