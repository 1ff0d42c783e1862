"""Run outputs: ``metrics.jsonl`` (one JSON object per logged step) and a loss plot; the model's
FLOPs per token, the devices' peaks and MFU; the step-time breakdown from CUDA events.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig, MoEConfig

# Dense bf16 tensor-core peaks, TFLOP/s, by a name the device's contains (the longest that matches
# wins: "H100 PCIe" before "H100"). Devices not listed, and CPUs, get no MFU.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "H800": 989.4, "H20": 148.0,
                    "A100": 312.0, "A800": 312.0, "B200": 2250.0}


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak (``PEAK_BF16_TFLOPS``), None on a CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    matches = [key for key in PEAK_BF16_TFLOPS if key in name]
    return PEAK_BF16_TFLOPS[max(matches, key=len)] if matches else None


def active_params(cfg: ModelConfig) -> int:
    """Weights a token multiplies with, per forward (matrices only: embeddings and the Engram
    tables are looked up, norms and biases are elementwise). Per block: attention ``4 D^2``
    (qkv, out), and the FFN: a dense SwiGLU ``3 D F`` (``F = model.dense_hidden``), or the MoE
    layer's (``moe_active_params``: router, ``topk`` routed and the shared experts); the LM head
    ``V D``. With mHC (``n`` streams) each sublayer's projection ``n (n + 2) n D`` and the head's
    ``n n D``; with Engram (``C`` hash columns of ``e`` wide rows) its key ``C e n D``, value
    ``C e D`` and short conv ``4 n D``."""
    d = cfg.hidden
    total = cfg.num_layers * 4 * d * d + cfg.dense_layers * 3 * d * cfg.dense_hidden
    total += (cfg.num_layers - cfg.dense_layers) * moe_active_params(cfg.moe, d) + cfg.vocab_size * d
    if cfg.mhc is not None:
        n = cfg.mhc.n
        total += cfg.num_layers * 2 * n * (n + 2) * n * d + n * n * d
    if cfg.engram is not None:
        e, n = cfg.engram, cfg.mhc.n if cfg.mhc is not None else 1
        memory = (e.max_ngram - 1) * e.num_heads * e.head_dim
        total += len(e.layers) * (memory * n * d + memory * d + 4 * n * d)
    return total


def moe_active_params(moe: MoEConfig, hidden: int) -> int:
    """Weights a token multiplies with in one MoE layer: the router ``E D``, and the ``topk``
    routed experts and the shared experts, ``3 D I`` each (SwiGLU: ``w13`` ``2 D I``, ``w2`` ``I D``)."""
    return moe.num_experts * hidden + (moe.router.topk + moe.num_shared_experts) * 3 * hidden * moe.expert_hidden


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs of one training step (forward + backward) per token of a ``seq_len`` sequence:

        6 * N_active + 6 * L * D * (S + 1)

    ``N_active = active_params(cfg)`` (2 FLOPs per weight forward, twice that backward); attention's
    scores and values ``Q K^T`` and ``P V`` take ``4 D`` FLOPs per (query, key) pair forward, over the
    ``(S + 1) / 2`` keys a query sees on average under the causal mask, times 3 with the backward."""
    return 6 * active_params(cfg) + 6 * cfg.num_layers * cfg.hidden * (seq_len + 1)


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


class StepTimes:
    """Where a step's time goes, from CUDA events: the step's phases as the training loop marks
    them (``span``: forward, backward, the gradients' reduction, the optimizer), and inside the
    forward every ``attention`` and ``experts`` module and every ``dispatch`` and ``combine``
    call, summed over the step's layers and micro-batches (the backward runs inside autograd,
    where these hooks do not reach). An event pair spans the stream's time between its marks,
    idle gaps included: a phase whose GPU waits for the host or a peer counts that wait. On a CPU
    there are no events and ``collect`` returns nothing. The pipeline's wait for its neighbours
    is measured by ``PipelineSchedule`` (wall clock, CPUs included)."""

    def __init__(self, model: nn.Module, device: torch.device, *, attention: type, experts: type):
        self.enabled = device.type == "cuda"
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: dict[tuple[str, int], torch.cuda.Event] = {}
        if not self.enabled:
            return
        for module in model.modules():
            part = "attention" if isinstance(module, attention) else "experts" if isinstance(module, experts) else None
            if part:
                module.register_forward_pre_hook(lambda m, args, part=part: self._start(part, m))
                module.register_forward_hook(lambda m, args, out, part=part: self._stop(part, m))
        dispatchers = {id(layer.dispatcher): layer.dispatcher for layer in getattr(model, "moe_layers", [])}
        for dispatcher in dispatchers.values():
            for member in getattr(dispatcher, "members", (dispatcher,)):  # one per lane, or itself
                for part in ("dispatch", "combine"):
                    setattr(member, part, self._timed(part, getattr(member, part)))

    def _start(self, part: str, key) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._open[part, id(key)] = event

    def _stop(self, part: str, key) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._events.append((part, self._open.pop((part, id(key))), event))

    @contextlib.contextmanager
    def span(self, part: str):
        """Times the work issued inside the block as ``part``."""
        if self.enabled:
            self._start(part, part)
        yield
        if self.enabled:
            self._stop(part, part)

    def _timed(self, part: str, fn):
        def timed(*args, **kwargs):
            self._start(part, fn)
            out = fn(*args, **kwargs)
            self._stop(part, fn)
            return out
        return timed

    def collect(self) -> dict[str, float]:
        """Seconds per part since the last call (waits for the events); empty on a CPU."""
        times: dict[str, float] = {}
        for part, start, end in self._events:
            end.synchronize()
            times[part] = times.get(part, 0.0) + start.elapsed_time(end) / 1e3
        self._events = []
        return times
