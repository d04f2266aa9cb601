"""The collectives ampfused uses, on the default or a given process group, and a DDP communication hook.

Every collective here is a tensor op: nothing is read to the host, so on CUDA with NCCL they queue on the
stream like the kernels around them.
"""
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def check_group(process_group, who: str):
    """``(group, rank, world)`` of ``process_group`` (``None``: the default group), or a clear error."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{who} needs torch.distributed initialised first (torch.distributed.init_process_group); "
                           "it reduces and gathers over a process group")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(process_group).__name__}")
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError(f"process_group: this process (global rank {dist.get_rank()}) is not a member of the group "
                         f"given to {who}")
    return process_group, rank, dist.get_world_size(process_group)


def all_reduce_sum_(t: Tensor, group=None) -> Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def reduce_scatter_sum(out: Tensor, inp: Tensor, group=None) -> None:
    _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group)


def all_gather(out: Tensor, inp: Tensor, group=None) -> None:
    _all_gather(out, inp, group=group)


def global_sum(t: Tensor, process_group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """The sum of ``t`` over the ranks of ``process_group``, as a new tensor (``t`` is left as it is); for
    example the token count of every rank's micro-batches, to pass as ``grad_divisor``. No host read."""
    if not isinstance(t, Tensor):
        raise TypeError(f"t must be a tensor (e.g. this rank's token count), got {type(t).__name__}")
    return all_reduce_sum_(t.detach().clone(), process_group)


def sum_hook(process_group: Optional[dist.ProcessGroup], bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook: all-reduce each bucket with a plain sum (DDP's default averages over ranks).

    Register it with ``ddp_model.register_comm_hook(None, ampfused.distributed.sum_hook)`` (or a process group
    instead of ``None``) when the losses are summed over tokens and the step divides once by the token count of
    every rank (``grad_divisor=ampfused.distributed.global_sum(tokens)``). With ``gradient_as_bucket_view=True``
    the sum lands in the gradients themselves. (DDP checks this function's annotations, so this module does not
    postpone their evaluation.)"""
    buf = bucket.buffer()
    work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
