"""Compiled kernels, a leaf package: ``kernels.cpu`` (C, loaded with ctypes) serves the model's
linear methods and layer operations, the CPU attention backend and the sampler alike."""
