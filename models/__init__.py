"""Model definitions, tasks and loaders: the zoo of tiny configs, the trained reference model,
the real pretrained model, and the retrieval tasks.

Imports: nothing of kvtopo (tests/test_import_layers.py)."""
