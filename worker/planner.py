"""The process's memory as the driver sees it: what the budget bounds, and what is left of it for a take.

`--memory-budget` bounds the whole worker process as the driver reports it (what `nvidia-smi` shows): the CUDA
context, kernels loaded into it (torch.compile'd, cuBLAS, flash attention), workspaces, graph pools, the KV
pool, weights and activations. torch's allocator cap only bounds what the allocator holds, so the measured gap
between the driver's figure and the allocator's -- the part outside it -- is taken off the budget before the
cap is set (measured at start, and again after the warm-up has loaded the kernels). Without a budget, the
default is the whole GPU minus `DEFAULT_MARGIN_BYTES`.

A take is then planned from what is actually left under the cap: everything the allocator holds counts --
weights, captured graphs' pools, cached tensors -- except the KV pool, which the next batch reuses (or
replaces).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from worker.memory import MIB

log = logging.getLogger("kevlaya.planner")

DEFAULT_MARGIN_BYTES = 512 * MIB  # without --memory-budget: the GPU's total minus this
# Kept free under the allocator cap for fragmentation (blocks cached but not of a reusable size). The context
# and other memory outside the allocator are measured, not guessed: this is only the allocator's own slack.
ALLOCATOR_SLACK_BYTES = 256 * MIB


@dataclass(frozen=True, kw_only=True)
class ProcessMemory:
    """One reading of the process's GPU memory."""

    driver_bytes: int  # the process as the driver reports it (NVML; device-wide used memory where unavailable)
    reserved_bytes: int  # what torch's caching allocator holds
    per_process: bool  # False: `driver_bytes` is the device's used memory (other processes included)

    @property
    def outside_allocator_bytes(self) -> int:
        """Context, loaded kernels, library workspaces: the driver's figure beyond the allocator's."""
        return max(0, self.driver_bytes - self.reserved_bytes)


def driver_bytes(device: torch.device) -> tuple[int, bool]:
    """This process's GPU memory as the driver reports it, and whether the figure is per process (NVML) or the
    device's whole used memory (`cudaMemGetInfo`, when NVML is missing or cannot name this process)."""
    try:
        import pynvml  # nvidia-ml-py; optional

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = device.index or 0
        if visible:
            index = int(visible.split(",")[index])
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory), True
    except Exception:  # no NVML, another PID namespace, a UUID in CUDA_VISIBLE_DEVICES: the device-wide figure
        pass
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free), False


def measure(device: torch.device) -> ProcessMemory:
    torch.cuda.synchronize(device)
    used, per_process = driver_bytes(device)
    return ProcessMemory(
        driver_bytes=used, reserved_bytes=int(torch.cuda.memory_reserved(device)), per_process=per_process
    )


def default_budget(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).total_memory) - DEFAULT_MARGIN_BYTES


def set_allocator_cap(device: torch.device, cap_bytes: int) -> None:
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, cap_bytes / total)), device)


def held_bytes(device: torch.device) -> int:
    """What the allocator holds that no new allocation can use: every segment still in use after the cached
    free ones are handed back -- weights, the KV pool, and the captured graphs' shared pool (the decode graphs
    capture into one pool, since only one replays at a time: it holds about the largest step's activations,
    not one set per graph, and `MAX_GRAPHS` bounds the graphs' own buffers)."""
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(device))
