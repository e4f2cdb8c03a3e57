"""Host tensors onto the GPU through one pinned buffer used as a ring, not a pinned copy made per tensor.

A copy to the GPU that does not wait for the stream needs page-locked host memory (from pageable memory CUDA
first waits for the stream: each prefill chunk's inputs would wait for the previous chunk's kernels).
`Tensor.pin_memory()` takes a pinned block per tensor from torch's caching host allocator, which hands a block
out again only once the copy that used it has run on the GPU: with the GPU behind the host, nearly every call
allocated afresh -- 250-500 us of host time each on the H200 machine, ~60 of them a 256-row scoring take, most
while the GPU waited for the take's first chunk. Here one buffer, pinned once per device, is cut into regions:
each tensor is copied into the next free bytes and sent from there, and before the ring comes round to a region
again it waits for the event recorded when it last left that region (its copies queued before it) -- long done
by then in practice, as a take sends a few MiB.
"""

from __future__ import annotations

import torch

from worker.fastpath.pointwise import on_device, raw_stream
from worker.memory import MIB

RING_BYTES = 32 * MIB
REGIONS = 4
# Each tensor's bytes start at a multiple of this: any dtype's view of them is aligned, and so are the copies.
ALIGN = 64


class PinnedRing:
    """Sends CPU tensors to `device` (non-blocking, on the current stream) through one pinned buffer."""

    def __init__(self, device: torch.device, nbytes: int = RING_BYTES) -> None:
        self.device = device
        self.region_bytes = nbytes // REGIONS // ALIGN * ALIGN  # every region starts aligned
        with torch.inference_mode(False):  # a buffer written outside inference mode too
            self.buffer = self._allocate(self.region_bytes * REGIONS)
        self.region = 0  # the region being filled...
        self.offset = 0  # ...its next free byte...
        self.stream: object = None  # ...and the stream its copies were queued on (None: none yet)
        self.left: list[torch.cuda.Event | None] = [None] * REGIONS  # recorded as the ring last left each region

    def send(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (on the CPU) copied to the device; one larger than a region through a pinned copy of its own.
        Refused while a CUDA graph is being captured: a graph would read the host bytes again at every replay,
        long after they were reused."""
        if self._capturing():
            raise RuntimeError("host tensors cannot be sent to the GPU while a CUDA graph is being captured")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.region_bytes:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        start = self.claim(nbytes, self._stream())
        staged = self.buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        staged.copy_(tensor)
        return staged.to(self.device, non_blocking=True)

    def claim(self, nbytes: int, stream: object = None) -> int:
        """The offset of `nbytes` free bytes, within one region, for a copy on `stream`: where they do not fit in
        the rest of the current region, or the region's copies went on another stream (its event is recorded on
        theirs), the next region, once the copies queued from it the last time round have run."""
        size = -(-nbytes // ALIGN) * ALIGN
        full = self.offset + size > (self.region + 1) * self.region_bytes
        if full or (self.stream is not None and stream != self.stream):
            self.left[self.region] = self._record()
            self.region = (self.region + 1) % REGIONS
            event, self.left[self.region] = self.left[self.region], None
            if event is not None:
                event.synchronize()
            self.offset = self.region * self.region_bytes
        self.stream = stream
        start = self.offset
        self.offset += size
        return start

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _stream(self) -> object:
        """The device's current stream, as its raw handle (cheap to read on every send)."""
        return raw_stream(self.device.index)

    def _record(self) -> torch.cuda.Event:
        """An event after the copies queued from the region being left, on the stream they went on."""
        event = torch.cuda.Event()
        if isinstance(self.stream, int) and self.stream != self._stream():
            event.record(torch.cuda.ExternalStream(self.stream, device=self.device))
        else:
            event.record(torch.cuda.current_stream(self.device))
        return event

    def _capturing(self) -> bool:
        """Whether this device's current stream is capturing."""
        with on_device(self.device):
            return torch.cuda.is_current_stream_capturing()


_RINGS: dict[torch.device, PinnedRing] = {}


def to_cuda(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor onto a CUDA `device` without waiting for its stream, through that device's ring."""
    device = torch.device("cuda", torch.cuda.current_device()) if device.index is None else device
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = PinnedRing(device)
    return ring.send(tensor.contiguous())
