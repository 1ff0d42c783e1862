"""An eager launch at the compiled function's host cost, and the never-read arguments it passes.

Training calls the dispatch and combine path eagerly, and at a small batch the host's issue time
is the call's time: a TileLang ``JITKernel``'s ``__call__`` matches its arguments against the
outputs it could allocate and re-derives their shapes on every call (~3.7 us of an 11.3 us launch
on an H200's host) before it calls the TVM-FFI function, which checks every argument's shape,
dtype and device itself. Kernels whose outputs the caller allocates skip that layer
(:func:`launcher`). A kernel build's unread arguments (a stand-in for an absent input) still
have to fit its dynamic sizes; :func:`stand_in` hands out one of each shape instead of an
allocation a call.
"""

import functools

import torch


@functools.cache
def launcher(kernel):
    """The TVM-FFI function ``kernel`` (a TileLang ``JITKernel``) runs, on the current stream: the
    same launch and argument checks without the Python layer. ``kernel`` itself for a kernel that
    allocates outputs (``out_idx``) or another execution backend."""
    adapter = getattr(kernel, "adapter", None)
    if adapter is None or getattr(adapter, "result_idx", None) or not hasattr(adapter, "_get_executable"):
        return kernel
    return adapter._get_executable()


@functools.lru_cache(maxsize=16)
def stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` for a kernel argument that is never read nor written,
    the same one on every call (a transport's sizes are static, so there are few shapes)."""
    return torch.empty(shape, dtype=dtype, device=device)
