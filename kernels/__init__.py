"""Kernel families of ep-runtime.

Each sub-package (``routing``, ``permute``, ``quant``, ``reduce``, ``transpose``, ``mhc``, ``engram``) holds a
``reference.py`` written in plain PyTorch, which is the specification, and TileLang kernels that
compute the same function on SM90+ GPUs. The family's ``__init__`` exports the public ops and picks
the implementation through :func:`kernels.select.use_tilelang`.
"""
