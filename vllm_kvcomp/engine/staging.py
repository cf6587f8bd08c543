"""Host -> device transfers of a step's plan, the one way host data reaches the device in a step.

A step's plan (which rows are ours, their lengths, query layout, page-table updates) is made on
the host from the scheduler's metadata. :meth:`HostStaging.send` packs the host tensors of one
plan into one pinned buffer and sends them with one ``non_blocking`` copy into a device buffer,
so a step neither copies from pageable memory nor waits for the device. The buffers form a ring:
one is written again only after the copy that last read it has run (its CUDA event, recorded
:data:`RING` sends before: in practice never waited on); what :meth:`send` returns is a view of
the ring, valid for the step (copy what must outlive it on the device). On a CPU "device" the
host tensors are the device tensors: nothing is copied (on ``meta``, which ``vllm-kvcomp bench
host`` uses to time the host alone, they become meta tensors).
"""

from __future__ import annotations

import torch

#: pinned buffers in the ring (a buffer is rewritten ``RING`` sends after its last copy)
RING = 4
ALIGN = 16  # bytes: every tensor starts aligned for any dtype's view


class HostStaging:
    """One transfer per :meth:`send` (see the module docstring); ``capacity`` bytes per buffer,
    grown when a send needs more (a step larger than any before)."""

    def __init__(self, device: torch.device | str, capacity: int = 1 << 20):
        self.device = torch.device(device)
        self.copies = self.device.type == "cuda"
        self.sends = 0  # transfers made (tests and the host benchmark count them)
        self._capacity = 0
        self._host: list[torch.Tensor] = []
        self._device: list[torch.Tensor] = []
        self._events: list[object | None] = []
        self._next = 0
        if self.copies:
            self._allocate(capacity)

    @property
    def capacity(self) -> int:
        """Bytes of each pinned buffer (and its device twin); 0 on a CPU device."""
        return self._capacity

    def _allocate(self, capacity: int) -> None:
        self._capacity = capacity
        self._host = [torch.empty(capacity, dtype=torch.uint8, pin_memory=True) for _ in range(RING)]
        self._device = [torch.empty(capacity, dtype=torch.uint8, device=self.device) for _ in range(RING)]
        self._events = [None] * RING

    def send(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Host ``tensors`` on the device (same dtypes and shapes) in one transfer; a tensor
        already on the device, or None, is returned as it is."""
        self.sends += 1
        if not self.copies:
            return tuple(t if t is None else t.to(self.device) for t in tensors)
        layout, offset = [], 0
        for t in tensors:
            if t is None or t.device.type != "cpu":
                layout.append(None)
                continue
            nbytes = t.numel() * t.element_size()
            layout.append((offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        if offset > self._capacity:
            self._allocate(max(offset, 2 * self._capacity))
        slot, self._next = self._next, (self._next + 1) % RING
        if self._events[slot] is not None:
            self._events[slot].synchronize()  # the copy that read this buffer RING sends ago
        host, device = self._host[slot], self._device[slot]
        for t, place in zip(tensors, layout):
            if place is not None:
                start, nbytes = place
                host[start : start + nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
        if offset:
            device[:offset].copy_(host[:offset], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._events[slot] = event
        return tuple(t if place is None else device[place[0] : place[0] + place[1]].view(t.dtype).view(t.shape)
                     for t, place in zip(tensors, layout))


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without a pageable copy: on CUDA through page-locked memory (torch's
    caching host allocator, which keeps it until the copy has run) and ``non_blocking``, so the
    host does not wait for the device; elsewhere as ``.to(device)``. For tensors made while a step
    or a decision runs whose size is not known ahead (a packing's rows); a step's plan goes
    through :class:`HostStaging`."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
