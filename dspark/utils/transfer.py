"""Host <-> device copies that never stall the stream behind the caller's back.

On CUDA a plain `torch.tensor(values, device="cuda")` or `.tolist()` is a synchronous copy: the host waits for every
queued kernel (and `torch.cuda.set_sync_debug_mode("error")` rejects it). Here uploads go through pinned host memory
with non_blocking copies (the caching host allocator keeps the pinned block alive until the copy has run), and
downloads are an asynchronous copy into pinned memory followed by a wait on an event recorded right after it: the one
point where the host needs the values, stated where it happens. On CPU both are plain conversions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D device tensor of these values, copied without a host sync."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def upload_tensor(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device, copied without a host sync (pinned first when it is not)."""
    if device.type != "cuda":
        return host.to(device)
    return (host if host.is_pinned() else host.pin_memory()).to(device, non_blocking=True)


class Download:
    """An asynchronous copy of device tensors to pinned host memory; `wait()` blocks on its event only."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensors and tensors[0].device.type == "cuda":
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self.host = [t.detach().cpu() for t in tensors]

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()  # NOTE: the step's one deliberate wait: the host needs these values now
            self._event = None
        return self.host


def download(*tensors: torch.Tensor) -> list[list]:
    """The tensors' values as (nested) lists, through one asynchronous copy and one event wait."""
    return [h.tolist() for h in Download(*tensors).wait()]
