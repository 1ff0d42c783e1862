"""Compiling TileLang kernels without a GPU, and reading their generated source.

``compile_only()`` makes every ``@tilelang.jit`` factory called inside it lower to CUDA for
``sm_90a`` and compile with nvcc on a machine without a GPU (CI does this for every kernel), with
TileLang's kernel cache off so a stale cached binary cannot hide a kernel that no longer compiles. ``kernel_source`` is the one place kernels' CUDA source is dumped from.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

SM90A = {"kind": "cuda", "arch": "sm_90a"}


@contextlib.contextmanager
def compile_only(target: dict = SM90A) -> Iterator[None]:
    import tilelang
    from tvm.target import Target

    tilelang.disable_cache()
    try:
        with Target(target):
            yield
    finally:
        tilelang.enable_cache()


def kernel_source(kernel, dump_dir: str | os.PathLike | None = None) -> str:
    """The CUDA source of a compiled kernel; also written to ``dump_dir`` (or ``$EP_KERNELS_DUMP``)
    as ``<name>.cu`` when one is given."""
    source = kernel.get_kernel_source()
    dump_dir = dump_dir or os.environ.get("EP_KERNELS_DUMP")
    if dump_dir:
        path = Path(dump_dir) / f"{kernel.prim_func.attrs['global_symbol']}.cu"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return source
