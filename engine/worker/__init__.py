"""The worker: the device, the model runner and its step inputs, CPU helpers, CUDA graphs and
the ranks of tensor and pipeline parallelism. This is where torch runs."""
