"""Run outputs: ``metrics.jsonl`` (one JSON object per logged step) and a loss plot."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("w")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def plot_loss(metrics_path: Path, png_path: Path, *, floor: float | None = None) -> Path:
    """Draws loss against step (and the data's loss floor, if given) into ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="training loss")
    if floor is not None:
        ax.axhline(floor, color="gray", linestyle="--", label="the data's floor (a model that knows the chain)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
