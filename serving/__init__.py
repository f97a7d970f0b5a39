"""kvtopo inside serving engines: the entry points other engines load.

`continuous_batching`: kvtopo's store as the KV cache of transformers' continuous batching
(`generate_batch`, `KvtopoBatchingManager`). `vllm_plugin` / `vllm_backend`: vLLM's plugin entry
point (see docs/vllm.md).

Imports: runtime, kernels and kvtopo.config only (tests/test_import_layers.py)."""
