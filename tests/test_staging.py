"""The pinned ring's bookkeeping (worker/fastpath/staging.py) on the CPU: where each tensor's bytes go and when
the ring waits; the copies themselves need a GPU (tests/test_gpu.py)."""

from __future__ import annotations

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
        super().__init__(torch.device("cpu"), nbytes)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def _record(self) -> FakeEvent:  # type: ignore[override]
        self.recorded += 1
        self.log.append(f"record {self.recorded}")
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
    assert ring.log == ["record 1", "record 2", "record 3"]
    ring.claim(10)  # back in the first region: its copies must have run
    assert ring.log[-2:] == ["record 4", "wait 1"]
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
