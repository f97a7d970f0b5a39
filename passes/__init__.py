"""torch.compile/FX passes that find attention in a graph and rewrite it into kvtopo ops.

Imports: kernels and kvtopo.config only (tests/test_import_layers.py)."""
