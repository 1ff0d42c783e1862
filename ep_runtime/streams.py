"""Work beside the current CUDA stream: the nvlink dispatcher's routes beside its rows, the MoE
layer's shared experts beside its routed path."""

from __future__ import annotations

import torch

from . import lanes


class SideStream:
    """``with side:`` runs its body on a stream of its own (``priority`` -1: high, so that a few
    small kernels get SMs between a long kernel's CTAs), after everything queued on the current
    stream so far; ``join()`` (or ``wait`` for a ``mark``) makes the current stream wait for it.
    On CPU, in line.

    Tensors allocated beside are used on the current stream after ``join``; the caching allocator
    hands their blocks out again only to work beside, which starts after everything queued on the
    current stream (the ``with``'s wait), so no ``record_stream`` is needed, as long as they are
    used on that stream only (a dispatch's route, for instance, on the stream that dispatched).
    Autograd runs a backward op on its forward op's stream, and orders the gradients that cross."""

    def __init__(self, device: torch.device, priority: int = 0):
        self.stream = torch.cuda.Stream(device, priority=priority) if device.type == "cuda" else None

    def __enter__(self):
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._context = torch.cuda.stream(self.stream)
            self._context.__enter__()

    def __exit__(self, *exc):
        if self.stream is not None:
            self._context.__exit__(*exc)

    def mark(self) -> torch.cuda.Event | None:
        """An event at this point of the side stream (None on CPU), for :meth:`wait`."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event: torch.cuda.Event | None) -> None:
        """The current stream waits for the side stream's work up to ``event``."""
        if event is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(event)

    def hold(self, tensor: torch.Tensor) -> None:
        """``tensor``, allocated on the current stream and read beside, is not handed out again
        before the side stream's work queued up to its release is done (a backward beside may read
        it last: autograd frees saved tensors without waiting for the streams that read them)."""
        if self.stream is not None:
            tensor.record_stream(self.stream)

    def join(self) -> None:
        """The current stream waits for everything queued beside so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


_beside: dict[tuple[torch.device, int], SideStream] = {}


def beside(device: torch.device) -> SideStream:
    """This process's side stream for ``device`` and the calling lane (``ep_runtime.lanes``: a
    lane joining work of another lane's would tie the two together)."""
    key = (device, lanes.current())
    if key not in _beside:
        _beside[key] = SideStream(device)
    return _beside[key]
