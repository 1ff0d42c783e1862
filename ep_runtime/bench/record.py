"""What every benchmark's JSON records about its run besides the measurements: the device, the
commit measured and whether the tree was dirty, the versions of the libraries involved."""

from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def git(*args: str) -> str | None:
    """``git <args>``'s output in the checkout, or None (no git, not a checkout, an error)."""
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def head_commit() -> str | None:
    return git("rev-parse", "HEAD")


def device_name(device) -> str:
    """The GPU's name, or the CPU's with the threads a process uses."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def version(module: str) -> str:
    """``module.__version__``, else the installed distribution's version, else why neither."""
    try:
        return str(__import__(module).__version__)
    except Exception as error:  # any failure to import is recorded, not raised
        try:
            from importlib.metadata import version as installed

            return installed(module.replace("_", "-"))
        except Exception:
            return f"unavailable ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"[:300]


def slug(name: str) -> str:
    """``name`` as a file name: lower case, runs of other characters as one ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"
