"""The GPU check harness (`python -m kvpilot.kernels.gpu_check`): correctness, compile,
CUDA-graph, quantization, speculation and parallel parts. It drives the engine, so unlike
the kernels it imports kvpilot.engine."""
