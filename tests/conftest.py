import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch, so recompile limits and caches never leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
