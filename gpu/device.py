"""Where tensors live, and CUDA stream ordering: transfers run on their own stream, ordered
after the compute stream with an event, so an offload never reads KV the compute stream is
still writing (the async-store failure of seed 000). On CPU every call runs synchronously and
the same code paths apply."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def default_device() -> torch.device:
    """cuda when this process sees a GPU, else cpu."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A host staging buffer: pinned when the pools are on CUDA (so copies can be async)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


class TransferStream:
    """The worker's transfer stream. `ordered()` runs a block of copies on it after everything
    already queued on the compute stream, and waits for them before returning, so a report is
    only ever sent for bytes that are really there."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    @contextmanager
    def ordered(self) -> Iterator[None]:
        if self.stream is None:
            yield  # cpu: every copy is synchronous already
            return
        compute_done = torch.cuda.current_stream(self.device).record_event()
        self.stream.wait_event(compute_done)
        with torch.cuda.stream(self.stream):
            yield
        self.stream.synchronize()
