"""Quantized models: checkpoint formats (GPTQ, AWQ, compressed-tensors), loading them, the
quantized linear layer and `quantize`. Packed layouts the kernels share live in kvpilot.kernels."""
