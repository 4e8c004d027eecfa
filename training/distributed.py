"""Several processes (one per GPU) under `torchrun` / `python -m torch.distributed.run`: the small helpers the trainer
and the self-distillation share. A single process (no WORLD_SIZE > 1 in the environment) never touches
torch.distributed: every helper here is then a no-op or returns the single-process answer.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def launched_world_size() -> int:
    """The number of processes torchrun started (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device_name: str | torch.device, timeout_s: float = 1800) -> torch.device:
    """Join the process group when torchrun started several processes; return this process's device.

    NCCL on CUDA (this process's GPU is cuda:LOCAL_RANK, whatever index `device_name` names), gloo on CPU. A single
    process returns `device_name` unchanged.
    """
    device = torch.device(device_name)
    if launched_world_size() <= 1:
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return device


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if rank_and_world()[1] > 1:
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def host_group():
    """A gloo group for small host-side collectives (wall-clock decisions) that must not wait on the GPU stream:
    the default group itself on CPU, a new gloo group beside NCCL. Every process must call this together."""
    if rank_and_world()[1] <= 1:
        return None
    return dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else dist.group.WORLD


def broadcast_from_main(values: list[float], group=None) -> list[float]:
    """Rank 0's `values` on every process (through `group`, a host_group(): CPU tensors)."""
    if rank_and_world()[1] <= 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.broadcast(tensor, src=0, group=group)
    return tensor.tolist()


def finish_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()
