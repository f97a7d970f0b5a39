"""kvtopo inside serving engines: the entry points other engines load.

`continuous_batching`: kvtopo's store as the KV cache of transformers' continuous batching
(`generate_batch`, `KvtopoBatchingManager`). `serve`: transformers' OpenAI-compatible server
(`transformers serve`) on that cache (`start_server`, `kvtopo serve`). `vllm_plugin` /
`vllm_backend`: vLLM's plugin entry point (see docs/vllm.md). `tensor_parallel`: a model sharded
with transformers' `tp_plan="auto"` across processes, each rank storing its own kv-heads
(`load_tensor_parallel`).

Imports: runtime, kernels, models and kvtopo.config only (tests/test_import_layers.py)."""
