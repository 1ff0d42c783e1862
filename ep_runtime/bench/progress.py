"""A benchmark's progress over its points, on rank 0: a tqdm bar on a terminal, else one line a
point (log files and Ray's log stream have no bar; GPU machines may lack tqdm)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``advance(what)`` after each of ``total`` points; nothing unless ``enabled``."""

    def __init__(self, name: str, total: int, *, enabled: bool):
        self.name, self.total, self.enabled = name, total, enabled
        self.done, self.start, self.bar = 0, time.monotonic(), None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, desc=name, file=sys.stderr, dynamic_ncols=True)

    def advance(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what)
            self.bar.update(1)
        elif self.enabled:
            print(f"{self.name}: {self.done}/{self.total} {what} ({time.monotonic() - self.start:.0f} s)", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
