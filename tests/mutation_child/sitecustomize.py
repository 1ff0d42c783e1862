"""Loaded at start-up by the Python processes a test starts while mutmut runs it (the root
``conftest.py`` puts this folder on ``PYTHONPATH`` then; nothing else does).

Such a process runs the mutant too: it inherits ``MUTANT_UNDER_TEST`` and, spawned, the test's
``sys.path`` with mutmut's ``mutants/`` tree first. Two things keep mutmut's view of it honest:
- While mutmut maps tests to the functions they reach (``MUTANT_UNDER_TEST=stats``), the process
  writes the functions it reached to ``$EP_MUTMUT_HITS/<pid>.json`` at exit, for the test to add
  to its own; otherwise a function reached only across processes would get no test at all.
- It dies with its parent: a mutant that hangs a collective gets the test killed at mutmut's
  timeout, and its ranks must not outlive it (``die_with_parent``; the root ``conftest.py`` calls
  it in the ranks it forks).
"""

import atexit
import ctypes
import json
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent left before the call took effect
        os._exit(1)


def _write_hits(folder: str) -> None:
    state = sys.modules.get("mutmut.state")
    if state is None:  # never reached a mutated function
        return
    with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
        json.dump(sorted(state.state()._stats), f)


if os.environ.get("MUTANT_UNDER_TEST"):
    die_with_parent()
    if os.environ.get("EP_MUTMUT_HITS"):
        atexit.register(_write_hits, os.environ["EP_MUTMUT_HITS"])
