"""The GPU probe's ``big`` stage: ops and a fused step over a buffer of more than 2**31 elements
(``python -m bench.gpu.probe big``)."""
from __future__ import annotations

import math
from typing import List

from .probe_common import Report, _torch, pick_device, sync, usable_backends


# ------------------------------------------------------------------------------------------------------ big

BIG_NUMEL = 2**31 + 17


def big_indices(n: int) -> List[int]:
    """Elements the big-buffer check writes: the first, around 2**31 (or the middle of a smaller buffer,
    for a dry run on the CPU), and the last."""
    b = 2**31 if n > 2**31 + 5 else n // 2
    return [0, b - 3, b, b + 5, n - 1]


def _big_label(n: int) -> str:
    return f"{n} elements" + (" (past 2**31)" if n > 2**31 else " (fewer than 2**31: a dry run)")


class _Big:
    """The buffers of the big-buffer check and what is expected of them."""

    def __init__(self, device, n: int):
        torch = _torch()
        self.device, self.n = device, n
        self.idx = torch.tensor(big_indices(n), device=device)
        self.vals = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], device=device)
        self.want_norm = math.sqrt(55.0)
        self.p = torch.zeros(n, device=device)
        self.g = None

    def reset(self, grad_dtype) -> None:
        torch = _torch()
        self.p.zero_()
        if self.g is None or self.g.dtype != grad_dtype:
            self.g = None
            self.g = torch.zeros(self.n, dtype=grad_dtype, device=self.device)
        else:
            self.g.zero_()
        self.g[self.idx] = self.vals.to(grad_dtype)

    def check_params(self, k: float, what: str) -> None:
        got = self.p[self.idx].tolist()
        want = (-0.5 * k * self.vals).tolist()  # k steps of lr 0.5 on gradients 1..5
        if got != want:
            raise AssertionError(f"{what}: params at {big_indices(self.n)} are {got}, expected {want}")
        nz = int(self.p.count_nonzero())
        if nz != 5:
            raise AssertionError(f"{what}: {nz} nonzero params, expected 5")
        if not math.isfinite(self.p.sum().item()):
            raise AssertionError(f"{what}: non-finite params")

    def check_norm(self, norm: float, what: str) -> None:
        if abs(norm - self.want_norm) > 1e-5:
            raise AssertionError(f"{what}: norm {norm}, expected sqrt(55) = {self.want_norm}")


def _big_ops(rep: Report, big: _Big, backend: str) -> None:
    """ops.norm_check + ops.sgd_step_ on an fp32 parameter and a bf16 gradient of ``big.n`` elements."""
    torch = _torch()
    from ampfused import ops
    device, n = big.device, big.n
    with rep.check(f"{backend}: ops.norm_check + ops.sgd_step_ over {_big_label(n)}: the norm, the elements "
                   "written updated, a NaN in the last element skips"):
        big.reset(torch.bfloat16)
        p, g = big.p, big.g
        inv, lr = torch.tensor(1.0, device=device), torch.tensor(0.5, device=device)
        steps = torch.zeros(1, device=device)
        out = torch.zeros(2, device=device)
        parts = ops.norm_check([g], inv, backend=backend)
        norm, found = ops.reduce_partials(parts)
        big.check_norm(norm.item(), "norm_check")
        if found.item() != 0.0:
            raise AssertionError(f"norm_check: found_inf {found.item()} on finite gradients")
        ops.sgd_step_([p], [g], None, None, steps, parts, inv, lr, out, backend=backend)
        big.check_norm(out[0].item(), "sgd_step_ out_stats")
        if out[1].item() != 0.0 or steps.item() != 1.0:
            raise AssertionError(f"sgd_step_: out_stats {out.tolist()}, steps {steps.item()}")
        big.check_params(1, "after one step")
        g[n - 1] = float("nan")
        parts = ops.norm_check([g], inv, backend=backend)
        ops.sgd_step_([p], [g], None, None, steps, parts, inv, lr, out, backend=backend)
        if out[1].item() != 1.0 or steps.item() != 1.0:
            raise AssertionError(f"NaN in the last element: out_stats {out.tolist()}, steps {steps.item()} "
                                 "(expected found_inf 1 and no step)")
        big.check_params(1, "after the NaN step")
        if backend == "cuda":  # the single cooperative launch too
            g[n - 1] = big.vals[-1].to(g.dtype)
            parts = torch.zeros(2, ops.num_partials([n], device=device, backend="cuda"), device=device)
            ops.get_backend("cuda").sgd_step_([p], [g], None, None, steps, parts, inv, lr, out, 0.0, 0.0, 0.0,
                                              False, math.inf, False, single_launch=True)
            big.check_norm(out[0].item(), "single launch out_stats")
            if out[1].item() != 0.0 or steps.item() != 2.0:
                raise AssertionError(f"single launch: out_stats {out.tolist()}, steps {steps.item()}")
            big.check_params(2, "after the single-launch step")


def _big_optimizer(rep: Report, big: _Big, backend: str) -> None:
    """FusedSGD over one fp32 parameter of ``big.n`` elements (its gradient fp32 too, as the optimizer needs)."""
    torch = _torch()
    import ampfused
    n = big.n
    with rep.check(f"{backend}: FusedSGD over one parameter of {_big_label(n)}: the norm, the elements written "
                   "updated, a NaN in the last element skips"):
        big.reset(torch.float32)
        param = torch.nn.Parameter(big.p)  # shares the buffer
        param.grad = big.g
        opt = ampfused.FusedSGD([param], lr=0.5, backend=backend)
        try:
            opt.step()
            big.check_norm(opt.last_grad_norm.item(), "last_grad_norm")
            if bool(opt.last_step_skipped):
                raise AssertionError("a finite step was skipped")
            big.check_params(1, "after one step")
            big.g[n - 1] = float("nan")
            opt.step()
            if not bool(opt.last_step_skipped):
                raise AssertionError("NaN in the last element: the step was not skipped")
            big.check_params(1, "after the NaN step")
        finally:
            param.grad = None
            del opt, param


def big_bytes(n: int, ops_only: bool) -> int:
    """Device memory the big-buffer check takes at its peak: the fp32 parameter, the gradient (bf16 for the
    ops, fp32 for the optimizer, whose momentum buffer is allocated too), a bool temporary, 1 GiB of slack."""
    return n * (4 + 2 + 1 if ops_only else 4 + 4 + 4 + 1) + 2**30


def probe_big(args) -> int:
    torch = _torch()
    device = pick_device(args.device)
    rep = Report("big", str(device))
    n = args.numel or BIG_NUMEL
    need = big_bytes(n, args.ops_only)
    rep.metrics.update(numel=n, bytes_needed=need)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        rep.metrics["bytes_free"] = free
        if free < need:
            rep.skip(f"needs {need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} GiB free")
            return rep.finish(args.json)
    elif n > 2**31:
        rep.note(f"a {n}-element buffer on the CPU: about {need / 2**30:.1f} GiB of memory")
    backends = usable_backends(rep, device, args.backends)
    if backends:
        big = _Big(device, n)
        try:
            for b in backends:
                _big_ops(rep, big, b)
            if not args.ops_only:
                for b in backends:
                    _big_optimizer(rep, big, b)
            sync(device)
        finally:
            big.p = big.g = None
    if args.ops_only:
        rep.note("--ops-only: the FusedSGD part was not run")
    return rep.finish(args.json)
