"""Reading the GPU's values on the host without waiting for its newer work (the offline loop's step-late reads)."""

from __future__ import annotations

from typing import Any

import torch


class HostCopy:
    """A small device tensor's values on the host, read later without waiting for the GPU's newer work.

    Why: ``.item()`` / ``.tolist()`` waits for everything queued before it, so reading a step's loss right after the
    step leaves the GPU idle while the host launches the next step. Here the copy is queued behind the work that makes
    the values (into pinned memory, with an event), and ``values()`` waits for that event only: read a step later,
    it has long finished. On the CPU it is a plain copy."""

    def __init__(self, values: torch.Tensor):
        values = values.detach()
        self.done: Any = None
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = values.clone()

    def values(self) -> list[float]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.reshape(-1).tolist()


def device_scalar(value: Any, device: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 0-d tensor on ``device`` from a number or a tensor, without a host sync: ``torch.as_tensor(2.0,
    device="cuda")`` copies from pageable host memory and waits for the GPU's queue; ``torch.full`` launches a
    fill kernel with the value as its argument."""
    if torch.is_tensor(value):
        return value.to(device=device, dtype=dtype).reshape(())
    return torch.full((), float(value), dtype=dtype, device=device)
