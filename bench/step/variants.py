"""What is benchmarked: torch's mixed-precision optimizer recipes, and ampfused on each available backend.

A *variant* builds a *runner* for one :class:`~bench.step.workloads.Instance`. Every runner offers the same
four things, so the checker and the timer treat them alike:

* ``set_grads(grads)``: put the gradients backward would have produced into the model's ``.grad``;
* ``step()``: one optimizer step, everything the training loop does between backward and the next forward
  (copy to master grads, unscale, inf check, clip, update, copy back, scale update);
* ``snapshot()``: the state to compare with the reference (per-tensor lists, no copies);
* ``tensors()``: every tensor it holds, for the memory count.

The torch recipe is the one the design measures against: ``torch.amp.GradScaler`` + ``unscale_`` +
``clip_grad_norm_(foreach=True)`` + ``AdamW`` on fp32 master weights, copied back to the model.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
from torch import Tensor, nn

from ..common.bytes import minimal_bytes_per_param
from .workloads import Instance


class Unavailable(Exception):
    """The variant cannot run here (missing build, no compiler, over its compile budget).

    ``permanent``: the reason holds for every later workload of the run too (no compiler, budget spent)."""

    def __init__(self, reason: str, permanent: bool = False):
        super().__init__(reason)
        self.permanent = permanent


@dataclass
class Snapshot:
    """State after some steps, as per-tensor lists in workload order (views; nothing is copied)."""
    param: List[Tensor]
    master: Optional[List[Tensor]]
    exp_avg: List[Tensor]
    exp_avg_sq: List[Tensor]
    scale: Optional[float] = None  # the loss scale now (None without a scaler)
    norm: Optional[Tensor] = None  # norm of the unscaled gradients of the last step, where reported


@dataclass
class Runner:
    variant: str
    backend: str
    notes: List[str] = field(default_factory=list)
    deviation: Optional[float] = None  # from the reference after the check steps (runner.weight_deviation)

    def set_grads(self, grads: List[Tensor]) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def snapshot(self) -> Snapshot:
        raise NotImplementedError

    def tensors(self) -> List[Tensor]:
        raise NotImplementedError

    def state_tensors(self) -> Optional[List[Tensor]]:
        """The optimizer state it keeps between steps beyond the model's weights and gradients (masters,
        moments, remainders, step counts), for the state-bytes column; None where not known."""
        return None


class Variant:
    """A named way to run the step; ``build`` raises :class:`Unavailable` with the reason when it cannot."""
    name = ""
    backend = ""
    is_torch = False  # a torch baseline (speedups are measured against these)

    def __init__(self) -> None:
        self.disabled: Optional[str] = None  # set when the variant gave up for the rest of the run

    def build(self, inst: Instance, params: List[Tensor]) -> Runner:
        raise NotImplementedError

    def bytes_per_param(self, inst: Instance) -> float:
        """The least bytes per parameter its step must move (bench/common/bytes.py); modes override it."""
        return minimal_bytes_per_param(inst.grad_dtype, inst.param_dtype, inst.master)

    def instance_for(self, inst: Instance) -> Instance:
        """The configuration this variant's users run where the benchmark runs ``inst`` (the peers: without a
        loss scaler); checked against the reference of that configuration and timed on its gradients."""
        return inst


# --------------------------------------------------------------------------------------------------------
# torch's recipe

class TorchRecipe(Runner):
    """bf16/fp16 model + fp32 master (or an fp32 model), GradScaler, clip_grad_norm_, AdamW."""

    def __init__(self, variant: str, backend: str, inst: Instance, params: List[Tensor], impl: str):
        super().__init__(variant, backend)
        self.inst = inst
        self.model = [nn.Parameter(p.detach().clone()) for p in params]
        for p in self.model:
            p.grad = torch.zeros_like(p)
        if inst.master:
            self.master = [nn.Parameter(p.detach().float()) for p in self.model]
            for p in self.master:
                p.grad = torch.zeros_like(p)
        else:
            self.master = self.model
        self._model_grads = [p.grad for p in self.model]
        self._master_grads = [p.grad for p in self.master]
        self.opt = torch.optim.AdamW(self.master, lr=inst.lr, betas=inst.betas, eps=inst.eps,
                                     weight_decay=inst.weight_decay, foreach=(impl == "foreach"),
                                     fused=(impl == "fused"))
        self.scaler = None
        if inst.scaler:
            self.scaler = torch.amp.GradScaler(inst.device.type, init_scale=inst.init_scale,
                                               growth_interval=inst.growth_interval)
            self.scaler.scale(torch.zeros((), device=inst.device))  # creates the scale tensor, as a loss would
        self.norm: Optional[Tensor] = None

    def set_grads(self, grads: List[Tensor]) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self._model_grads, grads)

    @torch.no_grad()
    def eager_step(self) -> Optional[Tensor]:
        if self.inst.master:
            torch._foreach_copy_(self._master_grads, self._model_grads)
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        norm = None
        if self.inst.clip:
            norm = torch.nn.utils.clip_grad_norm_(self.master, self.inst.max_norm, foreach=True)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        if self.inst.master:
            torch._foreach_copy_([p.data for p in self.model], [p.data for p in self.master])
        return norm

    def step(self) -> None:
        self.norm = self.eager_step()

    def snapshot(self) -> Snapshot:
        st = [self.opt.state[p] for p in self.master]
        return Snapshot(param=[p.detach() for p in self.model],
                        master=[p.detach() for p in self.master] if self.inst.master else None,
                        exp_avg=[s["exp_avg"] for s in st], exp_avg_sq=[s["exp_avg_sq"] for s in st],
                        scale=self.scaler.get_scale() if self.scaler is not None else None, norm=self.norm)

    def state_tensors(self) -> List[Tensor]:
        masters = [p.detach() for p in self.master] if self.inst.master else []
        return masters + [t for s in self.opt.state.values() for t in s.values() if isinstance(t, Tensor)]

    def tensors(self) -> List[Tensor]:
        out = [p.detach() for p in self.model] + self._model_grads
        if self.inst.master:
            out += [p.detach() for p in self.master] + self._master_grads
        out += [t for s in self.opt.state.values() for t in s.values() if isinstance(t, Tensor)]
        if self.scaler is not None:
            out += [t for t in (self.scaler._scale, self.scaler._growth_tracker) if t is not None]
        return out


class TorchForeach(Variant):
    name, backend, is_torch = "torch-foreach", "foreach", True

    def build(self, inst, params):
        return TorchRecipe(self.name, self.backend, inst, params, "foreach")


class TorchFused(Variant):
    name, backend, is_torch = "torch-fused", "fused", True

    def build(self, inst, params):
        try:
            return TorchRecipe(self.name, self.backend, inst, params, "fused")
        except RuntimeError as e:  # e.g. a device type without a fused AdamW kernel
            raise Unavailable(f"AdamW(fused=True) is not supported here: {e}") from e


class _Deadline(BaseException):  # not an Exception: compiler code must not swallow it
    pass


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise :class:`_Deadline` in this thread after ``seconds`` (main thread only; elsewhere no limit)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _fire(signum, frame):
        raise _Deadline()

    old = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class _DropProfilerNotice(logging.Filter):
    """Dynamo says once per process that it drops the profiler range ``Optimizer.step`` opens: a fact about
    tracing torch.optim, not about the benchmark, and a line between the progress bar and the table."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Profiler record function")


# the logger dynamo's context-manager tracing warns through (torch/_dynamo/variables/ctx_manager.py)
logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(_DropProfilerNotice())


class CompiledRecipe(TorchRecipe):
    """The foreach recipe's step under ``torch.compile``, as torch documents it: the step function compiled
    (master-grad copy, clip, copy back) and ``optimizer.step`` compiled. Dynamo does not trace
    ``GradScaler`` (torch/amp is on its skip list), so ``unscale_``/``update`` run eagerly between the
    compiled graphs and ``scaler.step`` calls the compiled ``optimizer.step`` after reading found_inf."""

    WATCHED_CALLS = 8  # the first calls may compile (the skip branch compiles when first taken)

    def __init__(self, variant, backend, inst, params, owner: "TorchCompile"):
        super().__init__(variant, backend, inst, params, "foreach")
        self.owner = owner
        self.compile_s = 0.0
        self._calls = 0
        self.opt.step = torch.compile(self.opt.step)  # what GradScaler.step ends up calling
        self._compiled: Callable = torch.compile(self.eager_step)

    def step(self) -> None:
        if self._calls >= self.WATCHED_CALLS:
            self.norm = self._compiled()
            return
        from torch._dynamo.utils import counters
        graphs_before = counters["stats"]["unique_graphs"]
        owner = self.owner
        t0 = time.perf_counter()
        try:
            with deadline(owner.budget_s - owner.spent_s):
                self.norm = self._compiled()
        except _Deadline:
            owner.spent_s = owner.budget_s
            raise Unavailable(f"torch.compile did not finish within the {owner.budget_s:.0f} s compile budget of "
                              "the run (--compile-budget)", permanent=True) from None
        except Exception as e:  # no C++ compiler, an inductor error: report, never time eager code as compiled
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise Unavailable(f"torch.compile failed: {type(e).__name__}: {first}", permanent=True) from e
        finally:
            dt = time.perf_counter() - t0
            self.compile_s += dt
            owner.spent_s += dt
        self._calls += 1
        if self._calls == 1 and counters["stats"]["unique_graphs"] == graphs_before:
            raise Unavailable("torch.compile produced no graph: the step would run eagerly")
        if self._calls == self.WATCHED_CALLS:
            self.notes.append(f"compile + first {self.WATCHED_CALLS} steps {self.compile_s:.1f} s")


class TorchCompile(Variant):
    """``budget_s`` bounds the time spent compiling over the whole run (the first calls of each runner);
    ``only``: the one workload it compiles on (the default run on CUDA, where a compile takes minutes), or None
    for every workload."""
    name, backend, is_torch = "torch-compile", "inductor", True

    def __init__(self, budget_s: float = 300.0, only: Optional[str] = None):
        super().__init__()
        self.budget_s = budget_s
        self.spent_s = 0.0
        self.only = only

    def build(self, inst, params):
        if self.only is not None and inst.workload.name != self.only:
            raise Unavailable(f"compiled on {self.only} only in the default run on this device (a compile takes "
                              "minutes here); --full, or --variants torch-compile, compiles every workload")
        if self.spent_s >= self.budget_s:
            raise Unavailable(f"the run's {self.budget_s:.0f} s compile budget is spent (--compile-budget)",
                              permanent=True)
        import torch._dynamo
        torch._dynamo.reset()  # each runner is a fresh compile; never hit the recompile limit and run eager
        return CompiledRecipe(self.name, self.backend, inst, params, self)


def torch_variants(compile_budget_s: float = 300.0, compile_only: Optional[str] = None) -> List[Variant]:
    """torch's three recipes (ampfused's variants, one per available backend, are in ampfused_variant)."""
    return [TorchForeach(), TorchFused(), TorchCompile(compile_budget_s, compile_only)]


def select(variants: List[Variant], names: Optional[List[str]]) -> List[Variant]:
    """The variants named (all when ``names`` is empty); unknown names fail with the list of known ones."""
    if not names:
        return variants
    by_name = {v.name: v for v in variants}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; available here: {list(by_name)}")
    return [by_name[n] for n in names]
