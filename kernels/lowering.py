"""Compiling TileLang kernels without a GPU, and reading their generated source.

``compile_only()`` makes every ``@tilelang.jit`` factory called inside it lower to CUDA for
``sm_90a`` and compile with nvcc on a machine without a GPU (CI does this for every kernel), with
TileLang's kernel cache off so a stale cached binary cannot hide a kernel that no longer compiles.
``kernel_source`` is the one place kernels' CUDA source is dumped from; ``waits_first`` reads it
for :func:`kernels.pdl.chained`.
"""

from __future__ import annotations

import contextlib
import os
import re
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


_KERNEL_OPEN = re.compile(r"__global__ void __launch_bounds__\([^)]*\) \w+\([^)]*\) \{\n")
# what may precede the PDL wait: shared-memory declarations and their views, locals set to constants
_DECLARATION = re.compile(r"(extern )?__shared__ |void\* \w+ = \(\(void\*\)\(\(char\*\)buf_dyn_shmem|"
                          r"[A-Za-z_][\w ]* \w+(\[\d+\])*( = (\([\w ]+\))?-?\d[\w.+]*)?;$")
_CHAINED = ["cudaTriggerProgrammaticLaunchCompletion();", "cudaGridDependencySynchronize();"]


def waits_first(source: str) -> bool:
    """True when every kernel in ``source`` opens with :func:`kernels.pdl.chained`'s trigger and
    wait with nothing but declarations before them (no load or store can precede the wait)."""
    bodies = [source[m.end():] for m in _KERNEL_OPEN.finditer(source)]
    for body in bodies:
        statements = (line.strip() for line in body.splitlines())
        statements = [s for s in statements if s and not _DECLARATION.match(s)]
        if statements[:2] != _CHAINED:
            return False
    return bool(bodies)
