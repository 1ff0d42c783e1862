"""Which checkpoints are whole: the completion marker, its checksums, and the newest valid step.

A step's folder holds torch.distributed.checkpoint's files (``.metadata`` and ``__<rank>_<i>.distcp``)
and, written last, ``complete.json``: the step, the layout and model config it was saved with, the
experts' placements, and every file's size and the sha256 of each ``PIECE`` bytes of it (pieces
hash in parallel: one thread hashes about 1 GB/s, and a whole-file sha256 of a 45 GB file took 45 s).
A folder without the marker is a partial save (killed while writing); a file whose size or sha256
differs from the marker's is truncated or corrupt. ``newest_valid`` walks the steps from the
newest, logs one line naming each folder it skips and the file at fault, and returns the first
whole one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("ep_runtime.checkpoint")

MARKER = "complete.json"
FORMAT = "ep-runtime dcp 2"
PIECE = 1 << 30  # bytes of a file one sha256 covers
_CHUNK = 1 << 22  # bytes hashed per read


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step}"


def steps_on_disk(directory: Path) -> list[int]:
    """Every ``step_<n>`` folder under ``directory``, whole or not, ascending."""
    if not Path(directory).is_dir():
        return []
    found = (re.fullmatch(r"step_(\d+)", entry.name) for entry in Path(directory).iterdir() if entry.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def fresh_run_refusal(directory: Path) -> str | None:
    """Why a fresh run (neither ``--resume`` nor ``--overwrite``) may not start with ``directory``
    as its checkpoint folder: the checkpoints already there. None if it holds none."""
    steps = steps_on_disk(directory)
    if not steps:
        return None
    return (f"{directory} holds checkpoints (steps {', '.join(map(str, steps))}): pass --resume to continue from "
            "the newest valid one, or --overwrite to delete them")


def _piece_sha256(path: Path, start: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        while length > 0 and (block := f.read(min(_CHUNK, length))):
            h.update(block)
            length -= len(block)
    return h.hexdigest()


def digests(paths: list[Path]) -> dict[str, dict]:
    """``{name: {"bytes": size, "sha256": [hex of each PIECE bytes]}}`` of the files ``paths``,
    their pieces hashed in parallel (hashlib releases the GIL)."""
    sizes = {path: path.stat().st_size for path in paths}
    pieces = [(path, start, min(PIECE, sizes[path] - start)) for path in paths
              for start in range(0, max(sizes[path], 1), PIECE)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(pieces), os.cpu_count() or 1, 32))) as pool:
        hashes = list(pool.map(lambda piece: _piece_sha256(*piece), pieces))
    out = {path.name: {"bytes": sizes[path], "sha256": []} for path in paths}
    for (path, _, _), sha in zip(pieces, hashes):
        out[path.name]["sha256"].append(sha)
    return out


def write_marker(folder: Path, marker: dict) -> None:
    """Writes ``complete.json`` atomically (a temporary file renamed): the save is complete."""
    tmp = folder / f".{MARKER}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, **marker}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MARKER)


def problem(folder: Path) -> str | None:
    """Why ``folder`` is not a whole checkpoint, naming the file; None if it is."""
    marker_path = folder / MARKER
    if not marker_path.is_file():
        return f"no {MARKER} (a partial save)"
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{MARKER} is unreadable ({type(error).__name__})"
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        return f"{MARKER}: expected format {FORMAT!r}"
    files = marker.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        return f"{MARKER} lists no .metadata"
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            what = "empty" if size == 0 else "truncated" if size < want["bytes"] else "longer than saved"
            return f"{name} is {what} ({size} bytes, saved {want['bytes']})"
    got = digests([folder / name for name in sorted(files)])
    for name in sorted(files):
        if got[name]["sha256"] != files[name]["sha256"]:
            return f"{name} is corrupt (its sha256 differs from {MARKER}'s)"
    return None


def read_marker(folder: Path) -> dict:
    return json.loads((folder / MARKER).read_text())


def newest_valid(directory: Path) -> tuple[int, dict] | None:
    """``(step, marker)`` of the newest whole checkpoint under ``directory``, None if there is none;
    logs a line for each newer one skipped."""
    for step in reversed(steps_on_disk(directory)):
        folder, start = step_dir(directory, step), time.perf_counter()
        why = problem(folder)
        if why is None:
            marker = read_marker(folder)
            log.info("checkpoint %s: %d files (%.1f MB) verified in %.2f s", folder, len(marker["files"]),
                     sum(f["bytes"] for f in marker["files"].values()) / 1e6, time.perf_counter() - start)
            return step, marker
        log.warning("checkpoint %s: %s: skipped for the previous valid one", folder, why)
    return None


def prune(directory: Path, keep: int) -> None:
    """Deletes the step folders older than the newest ``keep`` complete ones (a marker present)."""
    steps = steps_on_disk(directory)
    complete = [s for s in steps if (step_dir(directory, s) / MARKER).is_file()]
    if len(complete) < keep:
        return
    oldest_kept = complete[-keep]
    for step in steps:
        if step < oldest_kept:
            shutil.rmtree(step_dir(directory, step), ignore_errors=True)
