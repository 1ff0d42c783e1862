"""ep-runtime: an expert-parallel Mixture-of-Experts runtime for PyTorch.

Importing this package has no side effects: no process groups, no kernel compilation, no
environment changes. See ``ep_runtime.train`` for the worker that every launcher runs.
"""

__version__ = "0.1.0"
