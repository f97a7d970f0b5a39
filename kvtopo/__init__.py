"""kvtopo: compiler-pass based KV-cache compression for PyTorch LLM inference.

    model = kvtopo.compile(model)                    # or torch.compile(model, backend="kvtopo")
    with kvtopo.session(kvtopo.Config()) as s:
        out = kvtopo.generate(model, input_ids, max_new_tokens=64)
        print(s.stats().total_bytes)

The API layer: it may import every package; imports point one way below it (export ->
passes, runtime -> kernels; tests/test_import_layers.py).
"""

from kvtopo.config import Config
from kvtopo.runtime.session import CacheStats, Session

import kvtopo.kernels.ops  # noqa: E402,F401  (registers torch.ops.kvtopo.*)
from kvtopo.api import compile, current_session, inspect, session  # noqa: E402
from kvtopo.generate import generate  # noqa: E402
from kvtopo import hf_cache  # noqa: E402

__all__ = ["Config", "CacheStats", "Session", "compile", "current_session", "generate", "hf_cache", "inspect",
           "session"]
