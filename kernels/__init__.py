"""Triton kernels for the engine's paged KV cache, each beside a plain-torch reference.

Importing this package is cheap: nothing here imports triton or torch. Import the
kernels from their modules where they are used (the package deliberately does not
re-export them: a function named like its module would be shadowed by the module):

- ``kvpilot.kernels.kv_cache_write``: ``write_kv_cache``, ``write_kv_cache_reference``
- ``kvpilot.kernels.paged_decode_attention``: ``paged_decode_attention``,
  ``paged_decode_attention_reference``, ``choose_num_splits``
- ``kvpilot.kernels.paged_prefill_attention``: ``paged_prefill_attention``,
  ``paged_prefill_attention_reference``
- ``kvpilot.kernels.gpu_check``: the one-shot GPU correctness and bandwidth check
  (``python -m kvpilot.kernels.gpu_check``; ``--cpu`` runs its correctness part
  under the Triton interpreter)
- ``kvpilot.kernels.check.compile``: compiles every kernel variant for sm_90 with no GPU
- ``kvpilot.kernels.testing``: random paged-cache cases and a float64 dense oracle

In each module the Triton wrapper and the torch reference share one signature, so
an attention backend can call either.
"""
