"""The pinned ring's bookkeeping (worker/fastpath/staging.py) on the CPU: where each tensor's bytes go and when
the ring waits; the copies themselves need a GPU (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from worker.fastpath.staging import ALIGN, REGIONS, PinnedRing


class FakeEvent:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")


class HostRing(PinnedRing):
    """The ring over plain host memory, its events a log."""

    def __init__(self, nbytes: int) -> None:
        self.log: list[str] = []
        self.recorded = 0
        self.current = "default"  # the stream a copy would go on
        super().__init__(torch.device("cpu"), nbytes)

    def _stream(self) -> object:
        return self.current

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def _record(self) -> FakeEvent:  # type: ignore[override]
        self.recorded += 1
        self.log.append(f"record {self.recorded} on {self.stream}")
        return FakeEvent(self.log, str(self.recorded))

    def _capturing(self) -> bool:
        return False


def test_each_tensor_starts_aligned_inside_one_region() -> None:
    ring = HostRing(4 * 1024)
    region = ring.region_bytes
    for nbytes in (1, 100, 64, 1000, 7, 1024, 3, 500) * 4:
        start = ring.claim(nbytes)
        assert start % ALIGN == 0
        assert start // region == (start + nbytes - 1) // region


def test_the_ring_waits_for_a_region_only_when_it_comes_round_to_it_again() -> None:
    ring = HostRing(4 * 1024)  # four regions of 1 KiB
    for _ in range(REGIONS):
        ring.claim(1024)
    # Each claim filled a region: leaving one records its event; the first pass waits for none.
    assert ring.log == ["record 1 on None", "record 2 on None", "record 3 on None"]
    ring.claim(10)  # back in the first region: its copies must have run
    assert ring.log[-2:] == ["record 4 on None", "wait 1"]
    ring.claim(10)  # the same region again: no new wait
    assert ring.log[-1] == "wait 1"


def test_sent_tensors_keep_their_dtype_shape_and_values() -> None:
    ring = HostRing(4 * 1024)
    for tensor in (
        torch.arange(12, dtype=torch.int64).view(3, 4),
        torch.tensor([[True, False], [False, True]]),
        torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16).view(3, 1, 1),
        torch.empty(0, 5, dtype=torch.int64),
    ):
        got = ring.send(tensor)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor)


def test_copies_on_another_stream_start_a_region_of_their_own() -> None:
    """A region's event is recorded on the stream its copies went on: a copy on another stream moves on to the next
    region, recording the one it leaves on the stream of the copies queued from it."""
    ring = HostRing(4 * 1024)
    ring.send(torch.arange(4))
    ring.send(torch.arange(4))
    assert ring.log == [] and ring.region == 0
    ring.current = "side"
    ring.send(torch.arange(4))
    assert ring.log == ["record 1 on default"] and ring.region == 1
    ring.send(torch.arange(4))
    assert ring.region == 1


def test_a_ring_of_any_size_keeps_every_tensor_aligned_and_inside_its_buffer() -> None:
    ring = HostRing(4100)  # not a multiple of the regions' alignment
    assert ring.region_bytes % ALIGN == 0 and len(ring.buffer) == ring.region_bytes * REGIONS
    for nbytes in (1025, 8, 1000, 1, 1024) * 6:
        if nbytes > ring.region_bytes:
            continue
        start = ring.claim(nbytes, "default")
        assert start % ALIGN == 0 and start + nbytes <= len(ring.buffer)
    got = ring.send(torch.arange(100, dtype=torch.int64))
    assert torch.equal(got, torch.arange(100))


def test_nothing_is_sent_while_a_graph_is_being_captured() -> None:
    ring = HostRing(4 * 1024)
    ring._capturing = lambda: True  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="captured"):
        ring.send(torch.arange(4))


def test_a_ring_made_in_inference_mode_takes_writes_outside_it() -> None:
    with torch.inference_mode():
        ring = HostRing(4 * 1024)
    ring.buffer[:4].fill_(7)  # an inference tensor would refuse this outside inference mode
    assert torch.equal(ring.send(torch.arange(3)), torch.arange(3))
