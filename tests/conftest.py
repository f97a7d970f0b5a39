import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on this project's 2-core machines: one torch thread each, so
    # the workers do not oversubscribe the cores (tests that need more threads set them).
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch, so recompile limits and caches never leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
