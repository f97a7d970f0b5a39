"""The KV store a session keeps: page pool, lifecycle, encodings, budgets, eviction policies.

Imports: kernels and kvtopo.config only (tests/test_import_layers.py)."""
