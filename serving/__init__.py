"""kvtopo inside serving engines: the entry points other engines load (see docs/vllm.md).

Imports: runtime, kernels and kvtopo.config only (tests/test_import_layers.py)."""
