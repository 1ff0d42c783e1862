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


# Under mutmut (``MUTANT_UNDER_TEST`` set) the processes a test starts run the mutant too (they
# inherit the environment and the mutated tree), and:
# - while mutmut maps tests to the functions they reach ("stats"), spawned processes load
#   tests/mutation_child/sitecustomize.py and report the functions they reached, which count as the
#   test's own, so a mutant of what runs only across processes meets the tests that can kill it;
# - against a mutant, ``launch_local`` forks its ranks instead of spawning them: a fresh
#   interpreter importing torch costs seconds per rank and per mutant (OMP_NUM_THREADS=1, as the
#   mutation command sets, leaves no thread pool for a fork to break);
# - a collective that waits a minute fails (a clean test's whole run takes seconds): a mutant that
#   leaves the ranks' collectives unmatched fails then, not at the job's timeout of minutes;
# - the ranks die with the test, so those of a mutant that hangs anyway do not outlive mutmut's
#   timeout.
MUTATION_CHILD = os.path.join(os.path.dirname(__file__), "mutation_child")
_forked_ranks_die_with_test = False
MUTANT_COLLECTIVE_TIMEOUT_S = 60


def _die_with_parent():
    if _forked_ranks_die_with_test:
        sys.path.insert(0, MUTATION_CHILD)
        from sitecustomize import die_with_parent

        die_with_parent()


os.register_at_fork(after_in_child=_die_with_parent)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    global _forked_ranks_die_with_test
    mode = os.environ.get("MUTANT_UNDER_TEST")
    if not mode:
        yield
        return
    import tempfile
    from datetime import timedelta

    import torch.distributed as dist

    import launch.local

    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "EP_MUTMUT_HITS")}
    launch_config, init_process_group = launch.local.LaunchConfig, dist.init_process_group
    with tempfile.TemporaryDirectory() as hits:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [MUTATION_CHILD, saved["PYTHONPATH"]]))
        if mode == "stats":
            os.environ["EP_MUTMUT_HITS"] = hits
        else:
            launch.local.LaunchConfig = lambda **kw: launch_config(**(kw | {"start_method": "fork"}))
            timeout = timedelta(seconds=MUTANT_COLLECTIVE_TIMEOUT_S)
            dist.init_process_group = lambda *a, **kw: init_process_group(*a, **(kw | {"timeout": timeout}))
            _forked_ranks_die_with_test = True
        try:
            yield
        finally:
            launch.local.LaunchConfig, dist.init_process_group = launch_config, init_process_group
            _forked_ranks_die_with_test = False
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if mode == "stats":
            _add_child_hits(hits)


def _add_child_hits(folder):
    import json

    from mutmut.state import state

    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            state()._stats.update(json.load(f))
