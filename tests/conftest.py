import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(request):
    """A per-test seed derived from the test's name, so each test draws its own fresh inputs."""
    import zlib

    s = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(s)
    return s


@pytest.fixture
def stub_kernel(monkeypatch):
    """``stub_kernel(module, name, result)``: ``module.name`` (a TileLang kernel's entry point)
    replaced by a stub that records its calls and returns ``result``; returns the list of calls.
    A test of an op's selection then sees which implementation ran without a GPU."""

    def stub(module, name, result):
        calls = []

        def kernel(*args, **kwargs):
            calls.append((args, kwargs))
            return result

        monkeypatch.setattr(module, name, kernel)
        return calls

    return stub


# Worker functions for multi-process tests live in tests/workers/ and are imported by name in the
# spawned processes, so that directory must be importable there too.
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
# The independent specifications (tests/spec/moe_spec.py, model_spec.py), imported by tests and workers.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "spec"))
