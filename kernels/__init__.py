"""Attention math as plain tensor ops: the kvtopo custom ops, the float64/torch references, the
C++ and Triton decode kernels, quantization, principal bases and the exp-free score.

Imports: nothing of kvtopo (tests/test_import_layers.py). Kernels take tensors and the small
dataclasses defined here; the runtime adapts its store to them, and the ops reach the store
through the hook in store_hook.py, which the runtime sets."""
