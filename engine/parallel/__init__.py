"""Tensor and pipeline parallelism: one engine over several processes (GPUs on CUDA).

The driver process keeps the scheduler, the KV cache manager and sampling, and runs rank 0;
ranks 1.. are worker processes it starts and watches (workers.py). Each step's inputs are
sent from rank 0 once (group.py); every rank runs its shard of the model (sharding.py,
sharded_reader.py) and the all-reduces inside it."""
