"""Attention over the paged KV cache: the layer the model calls, the per-step metadata it reads,
and the CPU backend (a C decode kernel and torch prefill). Triton backends live in kvpilot.kernels."""
