"""The workloads ``python -m bench.gpu_check`` runs, one subcommand each: ``python -m bench.gpu_probe NAME``.

* ``env``: versions, the device, its free memory (what the driver's summary header shows).
* ``sanitize``: every op of ``ampfused.ops`` on each backend over small tensors of awkward sizes and layouts
  (one element, odd sizes, ``channels_last``, a transpose, a view one element into its storage, a parameter
  without a gradient), the CUDA backend's single-launch step, and a few steps of each fused optimizer with
  ``ampfused.GradScaler``: short enough to run under ``compute-sanitizer``. Results are compared with the
  reference backend run on CPU copies, so the sanitizer sees ampfused's kernels and a few copies.
* ``sync-debug``: ``scaler.step(opt); scaler.update()`` of FusedAdamW / FusedAdam / FusedSGD under
  ``torch.cuda.set_sync_debug_mode("error")``, for a model built on the CPU and moved to the device after its
  optimizer was built, gradients set to None between steps, checked against a twin on the reference backend.
* ``graph``: a warmed-up ``opt.step()`` (and ``scaler.step(opt); scaler.update()``) captured in a CUDA graph
  and replayed with fresh gradient values copied into the fixed gradient tensors (one replay overflows),
  compared bit for bit with an eager twin that gets fresh gradient tensors each step.
* ``counts``: kernels per fused step (``torch.profiler``), host time per eager step and the replay time of
  the captured step, with and without the scaler, at 1M parameters in 200 and in 2000 tensors. Reported,
  not asserted.
* ``big``: a gradient of more than 2**31 elements: the norm, the update of elements past 2**31, and a NaN in
  the last element skipping the step, through the ops and through FusedSGD, on each backend.
* ``bench``: ``python -m bench`` over reduced workloads, torch-compile left out.

Every subcommand takes ``--device`` (``cuda`` when available, else ``cpu``): on the CPU the same workload
runs on the CPU backend (and the Triton interpreter when ``TRITON_INTERPRET=1``), without what only CUDA has
(the sync-debug mode, graph capture, kernel launches). ``--json FILE`` writes the checks and measurements.
Exit status: 0 every check passed, 1 a check failed, 3 the whole probe could not run here (the reason is
printed and written), 2 a usage error.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

SKIP_EXIT = 3


# ---------------------------------------------------------------------------------------------- reporting

class Report:
    """Named checks (each one runs on, whatever the others did), measurements and notes of one probe."""

    def __init__(self, probe: str, device: str) -> None:
        self.probe, self.device = probe, device
        self.checks: List[dict] = []
        self.metrics: Dict[str, object] = {}
        self.notes: List[str] = []
        self.skip_reason: Optional[str] = None

    @contextlib.contextmanager
    def check(self, name: str):
        """Run the body as the check ``name``: an exception fails it (with its message) and is not raised."""
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any error is this check's failure
            msg = f"{type(e).__name__}: {e}".strip()
            self.checks.append(dict(name=name, ok=False, error=_clip(msg, 2000),
                                    seconds=round(time.perf_counter() - t0, 3)))
            print(f"FAIL {name}: {_clip(msg, 500)}", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
        else:
            self.checks.append(dict(name=name, ok=True, seconds=round(time.perf_counter() - t0, 3)))
            print(f"ok   {name}", flush=True)

    def fail(self, name: str, why: str) -> None:
        self.checks.append(dict(name=name, ok=False, error=why, seconds=0.0))
        print(f"FAIL {name}: {why}", flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"note {text}", flush=True)

    def skip(self, reason: str) -> None:
        self.skip_reason = reason

    def finish(self, json_path: Optional[str]) -> int:
        failed = [c["name"] for c in self.checks if not c["ok"]]
        if self.skip_reason is not None and not self.checks:
            status, code = "skip", SKIP_EXIT
            line = f"probe {self.probe}: SKIP: {self.skip_reason}"
        elif failed:
            status, code = "fail", 1
            line = f"probe {self.probe}: FAILED {len(failed)} of {len(self.checks)} checks: {', '.join(failed)}"
        elif not self.checks:
            status, code = "fail", 1
            line = f"probe {self.probe}: FAILED: no check ran"
        else:
            status, code = "ok", 0
            line = f"probe {self.probe}: ok ({len(self.checks)} checks on {self.device})"
        if json_path:
            with open(json_path, "w") as f:
                json.dump(dict(probe=self.probe, device=self.device, status=status, reason=self.skip_reason,
                               summary=line, checks=self.checks, metrics=self.metrics, notes=self.notes), f,
                          indent=1, default=str)
        print(line, flush=True)
        return code


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " [...]"


# ------------------------------------------------------------------------------------------------ helpers

def _torch():
    import torch
    return torch


def pick_device(name: Optional[str]):
    torch = _torch()
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch sees no CUDA device")
    return device


def default_backends(device) -> List[str]:
    """The fast backends this probe checks on ``device``: cuda and triton on a GPU; on the CPU the native
    backend, and Triton when its interpreter is on (``TRITON_INTERPRET=1``)."""
    if device.type == "cuda":
        return ["cuda", "triton"]
    return ["cpu"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


def usable_backends(rep: Report, device, wanted: Optional[Sequence[str]]) -> List[str]:
    """The backends of ``wanted`` that can run on ``device``; each one that cannot is a failed check (on a GPU
    machine both GPU backends are expected to run: one missing is what this check is for)."""
    from ampfused import ops
    out = []
    for b in wanted or default_backends(device):
        reasons = ops.registry.reasons_for(b, device)
        if reasons:
            rep.fail(f"backend {b} on {device.type}", "cannot run: " + "; ".join(reasons))
        else:
            out.append(b)
    return out


def sync(device) -> None:
    torch = _torch()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def placed(values, shape, layout: str, dtype, device):
    """A tensor of ``shape`` laid out as ``layout`` (plain, channels_last, transposed, offset: one element
    into its storage, so not 16-byte aligned) whose elements in memory order are ``values`` (1-D)."""
    torch = _torch()
    from ampfused.ops import memory_view
    n = math.prod(shape)
    if layout == "channels_last":
        t = torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)
    elif layout == "transposed":
        t = torch.empty(shape[::-1], dtype=dtype, device=device).t()
    elif layout == "offset":
        t = torch.empty(n + 1, dtype=dtype, device=device)[1:].view(shape)
    else:
        t = torch.empty(shape, dtype=dtype, device=device)
    memory_view(t).copy_(values.reshape(-1).to(device=device, dtype=dtype))
    return t


def assert_bitwise(what: str, a, b) -> None:
    torch = _torch()
    a, b = a.detach(), b.detach()
    if a.device != b.device:
        b = b.to(a.device)
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
    if not bool(same.all()):
        bad = (~same).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {int(bad.shape[0])} of {a.numel()} elements differ, first at {first}: "
                             f"{a[first].item()!r} vs {b[first].item()!r}")


def assert_close(what: str, a, b, rtol: float, atol: float) -> None:
    torch = _torch()
    a, b = a.detach().float(), b.detach().float()
    if a.device != b.device:
        b = b.to(a.device)
    try:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


AWKWARD_SPECS = [  # (shape, layout, has a gradient, initial step count)
    ((1,), "plain", True, 3), ((7,), "plain", True, 0), ((127,), "offset", True, 1), ((16385,), "plain", True, 0),
    ((65537,), "plain", True, 5), ((2, 3, 5, 7), "channels_last", True, 2), ((300,), "plain", False, 4),
    ((45, 67), "transposed", True, 0), ((1000,), "offset", True, 0),
]


# ------------------------------------------------------------------------------------------------------ env

def probe_env(args) -> int:
    torch = _torch()
    rep = Report("env", "host")
    info: Dict[str, object] = dict(python=platform.python_version(), executable=sys.executable,
                                   torch=torch.__version__, torch_cuda=torch.version.cuda, cpus=os.cpu_count())
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        info["triton"] = f"unavailable ({type(e).__name__}: {e})"
    with rep.check("torch imports and reports its devices"):
        info["cuda_available"] = bool(torch.cuda.is_available())
        if info["cuda_available"]:
            i = torch.cuda.current_device()
            p = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            info.update(device=p.name, capability=f"{p.major}{p.minor}", sms=p.multi_processor_count,
                        memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1),
                        device_count=torch.cuda.device_count())
        else:
            info["device"] = "cpu"
    try:
        import ampfused
        info["ampfused"] = ampfused.__version__
    except Exception as e:  # noqa: BLE001 - not installed yet: the build stage installs it
        info["ampfused"] = f"not importable ({type(e).__name__}: {e})"
    rep.metrics.update(info)
    for k, v in info.items():
        print(f"{k}: {v}")
    return rep.finish(args.json)


# ------------------------------------------------------------------------------------------------- sanitize

def _step_problem(specs, pdtype, gdtype, has_master, device, gen):
    """Parameters where they live, flat state laid out by state_layout (gaps hold NaN), step counts and one
    set of gradients (None where the spec says so): a copy on ``device`` and a reference copy on the CPU."""
    torch = _torch()
    from ampfused import ops
    numels = [math.prod(s[0]) for s in specs]
    offsets, total = ops.state_layout(numels)
    w, m, v = (torch.full((total,), float("nan")) for _ in range(3))
    for off, n in zip(offsets, numels):
        w[off:off + n] = torch.randn(n, generator=gen)
        m[off:off + n] = torch.randn(n, generator=gen) * 1e-3
        v[off:off + n] = torch.rand(n, generator=gen) * 1e-6
    gvals = [torch.randn(n, generator=gen) * 64.0 if s[2] else None for s, n in zip(specs, numels)]
    copies = []
    for dev in (device, torch.device("cpu")):
        pd = pdtype if has_master else torch.float32
        copies.append(dict(
            params=[placed(w[off:off + n], s[0], s[1], pd, dev) for s, off, n in zip(specs, offsets, numels)],
            master=w.clone().to(dev) if has_master else None, s1=m.clone().to(dev), s2=v.clone().to(dev),
            steps=torch.tensor([float(s[3]) for s in specs], device=dev), offsets=offsets,
            grads=[None if g is None else placed(g, s[0], s[1], gdtype, dev) for s, g in zip(specs, gvals)]))
    return copies


def _run_step(kind: str, s: dict, partials, inv, lr, out, backend: str, cfg: dict) -> None:
    from ampfused import ops
    if kind == "adam":
        ops.adam_step_(s["params"], s["grads"], s["master"], s["s1"], s["s2"], s["steps"], partials, inv, lr, out,
                       backend=backend, **cfg)
    else:
        ops.sgd_step_(s["params"], s["grads"], s["master"], s["s1"] if cfg.get("momentum", 0) else None,
                      s["steps"], partials, inv, lr, out, backend=backend, **cfg)


def _compare_problem(what: str, fast: dict, ref: dict, rtol=1e-5, atol=1e-6) -> None:
    from ampfused.ops import memory_view
    assert_bitwise(f"{what}: steps", fast["steps"], ref["steps"])
    for key in ("master", "s1", "s2"):
        if fast[key] is not None:
            assert_close(f"{what}: {key}", fast[key], ref[key], rtol, atol)
    for i, (a, b) in enumerate(zip(fast["params"], ref["params"])):
        if fast["master"] is None:
            assert_close(f"{what}: params[{i}]", memory_view(a), memory_view(b), rtol, atol)
            continue
        off, n = fast["offsets"][i], a.numel()  # the model copy is its master rounded, bit for bit
        assert_bitwise(f"{what}: params[{i}] is its master rounded", memory_view(a),
                       fast["master"][off:off + n].to(a.dtype))


def _sanitize_ops(rep: Report, device, backend: str) -> None:
    torch = _torch()
    from ampfused import ops
    from ampfused.ops import reference as R
    F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
    gen = torch.Generator().manual_seed(0)
    specs = [s for s in AWKWARD_SPECS if s[2]]

    def on_device(tensors, which=None):  # copies in the same layouts (a misaligned view stays misaligned)
        return [placed(ops.memory_view(t), s[0], s[1], t.dtype, device)
                for i, (t, s) in enumerate(zip(tensors, specs)) if which is None or i in which]

    for dt in (F32, BF16, F16):
        name = str(dt).replace("torch.", "")
        grads_cpu = [placed(torch.randn(math.prod(s[0]), generator=gen) * 8.0, s[0], s[1], dt, "cpu") for s in specs]
        grads_cpu[3].view(-1)[11] = float("inf")
        inv = torch.tensor(1 / 8.0, device=device)
        with rep.check(f"{backend} num_partials + norm_check {name}"):
            grads = on_device(grads_cpu)
            want = ops.num_partials([g.numel() for g in grads], device=device, backend=backend)
            p = ops.norm_check(grads, inv, backend=backend)
            if tuple(p.shape) != (2, want):
                raise AssertionError(f"partials shape {tuple(p.shape)}, num_partials says (2, {want})")
            norm, found = ops.reduce_partials(p)
            rnorm, rfound = R.reduce_partials(R.norm_check(grads_cpu, inv.cpu()))
            assert found.item() == rfound.item() == 1.0, (found.item(), rfound.item())
            finite = [g for i, g in enumerate(grads_cpu) if i != 3]
            fn, _ = ops.reduce_partials(ops.norm_check(on_device(grads_cpu, [i for i in range(len(specs)) if i != 3]),
                                                       inv, backend=backend))
            rn, _ = R.reduce_partials(R.norm_check(finite, inv.cpu()))
            assert_close("norm of the finite gradients", fn.cpu(), rn, 1e-5, 0)
        with rep.check(f"{backend} unscale_ {name}"):
            grads = on_device(grads_cpu)
            ref = [g.clone() for g in grads_cpu]
            p = ops.unscale_(grads, inv, backend=backend)
            rp = R.unscale_(ref, inv.cpu())
            for i, (a, b) in enumerate(zip(grads, ref)):
                assert_bitwise(f"grads[{i}]", a.cpu(), b)
            assert ops.reduce_partials(p)[1].item() == R.reduce_partials(rp)[1].item() == 1.0
    with rep.check(f"{backend} update_scale_"):
        for scale, tracker, found in ((65536.0, 0, 0.0), (65536.0, 1, 0.0), (3.0e38, 1, 0.0), (1024.0, 1, 1.0)):
            a = (torch.tensor(scale, device=device), torch.tensor(tracker, dtype=torch.int32, device=device),
                 torch.tensor(found, device=device))
            b = tuple(t.cpu().clone() for t in a)
            ops.update_scale_(*a, 2.0, 0.5, 2, backend=backend)
            R.update_scale_(*b, 2.0, 0.5, 2)
            assert_bitwise(f"scale {scale}", a[0].cpu(), b[0])
            assert_bitwise(f"tracker {tracker}", a[1].cpu(), b[1])
    cases = [("adam", BF16, BF16, True, dict(decoupled=True, weight_decay=0.01, max_norm=0.5)),
             ("adam", F32, F16, False, dict(decoupled=False, weight_decay=0.01, maximize=True)),
             ("adam", F16, F16, True, dict(decoupled=True, beta1=0.0, beta2=0.99)),
             ("sgd", BF16, BF16, True, dict(momentum=0.9, nesterov=True, weight_decay=1e-4, max_norm=0.5)),
             ("sgd", F32, F32, False, dict(momentum=0.9, dampening=0.1)),
             ("sgd", F16, F16, True, dict())]
    for kind, pdt, gdt, has_master, cfg in cases:
        label = f"{backend} {kind}_step_ {str(pdt)[6:]} params, {str(gdt)[6:]} grads, {cfg}"
        with rep.check(label):
            fast, ref = _step_problem(AWKWARD_SPECS, pdt, gdt, has_master, device, gen)
            lr = torch.tensor(1e-3)
            inv = torch.tensor(1 / 64.0)
            for k in range(2):  # the second step sees an inf and must change nothing
                if k == 1:
                    for s in (fast, ref):
                        ops.memory_view(s["grads"][4])[17] = float("inf")
                before = [t.clone() for t in fast["params"]] + [fast["steps"].clone()]
                for s, dev in ((fast, device), (ref, torch.device("cpu"))):
                    active = [g for g in s["grads"] if g is not None]
                    i_, l_ = inv.to(dev), lr.to(dev)
                    parts = ops.norm_check(active, i_, backend=backend if s is fast else "reference")
                    out = torch.zeros(2, device=dev)
                    _run_step(kind, s, parts, i_, l_, out, backend if s is fast else "reference", cfg)
                    s["out"] = out
                assert_close(f"step {k}: out_stats", fast["out"].cpu(), ref["out"], 1e-5, 0)
                _compare_problem(f"step {k}", fast, ref)
                if k == 1:
                    for i, b in enumerate(before[:-1]):
                        assert_bitwise(f"skipped step: params[{i}]", fast["params"][i], b)
                    assert_bitwise("skipped step: steps", fast["steps"], before[-1])
    if backend == "cuda" and device.type == "cuda":
        _sanitize_single_launch(rep, device, gen)


def _sanitize_single_launch(rep: Report, device, gen) -> None:
    """The CUDA backend's single cooperative launch (K1, grid barrier, K2) against its two-kernel path."""
    torch = _torch()
    from ampfused import ops
    b = ops.get_backend("cuda")
    BF16 = torch.bfloat16
    for kind in ("adam", "sgd"):
        with rep.check(f"cuda single_launch {kind}_step_ equals the two-kernel step"):
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
            one, _ = _step_problem(AWKWARD_SPECS, BF16, BF16, True, device, torch.Generator().manual_seed(seed))
            two, _ = _step_problem(AWKWARD_SPECS, BF16, BF16, True, device, torch.Generator().manual_seed(seed))
            inv, lr = torch.tensor(1 / 64.0, device=device), torch.tensor(1e-3, device=device)
            active = [g for g in one["grads"] if g is not None]
            ncols = ops.num_partials([g.numel() for g in active], device=device, backend="cuda")
            for k in range(2):
                if k == 1:
                    for s in (one, two):
                        ops.memory_view(s["grads"][1])[3] = float("nan")
                p2 = ops.norm_check([g for g in two["grads"] if g is not None], inv, backend="cuda")
                p1 = torch.full((2, ncols), float("nan"), device=device)
                o1, o2 = torch.zeros(2, device=device), torch.zeros(2, device=device)
                for s, p, o, single in ((one, p1, o1, True), (two, p2, o2, False)):
                    if kind == "adam":
                        b.adam_step_(s["params"], s["grads"], s["master"], s["s1"], s["s2"], s["steps"], p, inv, lr,
                                     o, 0.9, 0.999, 1e-8, 0.01, 0.5, True, single_launch=single)
                    else:
                        b.sgd_step_(s["params"], s["grads"], s["master"], s["s1"], s["steps"], p, inv, lr, o, 0.9,
                                    0.0, 1e-4, True, 0.5, single_launch=single)
                assert_bitwise(f"step {k}: partials", p1, p2)
                assert_bitwise(f"step {k}: out_stats", o1, o2)
                for key in ("master", "s1", "s2", "steps"):
                    assert_bitwise(f"step {k}: {key}", one[key], two[key])
                for i, (x, y) in enumerate(zip(one["params"], two["params"])):
                    assert_bitwise(f"step {k}: params[{i}]", x, y)


# A fused optimizer against its twin on the reference backend: loose enough for any order of fp32 sums (an Adam
# step divides by sqrt(v) + eps, which magnifies them where a gradient is tiny), tight enough for a wrong rule.
# The suite holds each backend to the fp64 oracle; these probes look for memory errors, syncs and capture.
TWIN_TOL = (1e-4, 1e-5)

OPTIMIZERS = [  # (class name, hyperparameters)
    ("FusedAdamW", dict(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)),
    ("FusedAdam", dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)),
    ("FusedSGD", dict(lr=1e-2, momentum=0.9, nesterov=True, max_grad_norm=1.0)),
]


def _awkward_params(device, dtype, gen, specs=AWKWARD_SPECS):
    torch = _torch()
    return [torch.nn.Parameter(placed(torch.randn(math.prod(s[0]), generator=gen), s[0], s[1], dtype, device))
            for s in specs]


def _masters(opt, params):
    return [opt.state[p]["master_param"] if "master_param" in opt.state[p] else p.detach() for p in params]


def _sanitize_optimizers(rep: Report, device, backend: str) -> None:
    """A few steps of each fused optimizer with ampfused.GradScaler (one overflowing), against a twin on the
    reference backend on the CPU."""
    torch = _torch()
    import ampfused
    for cls_name, kw in OPTIMIZERS:
        with rep.check(f"{backend} {cls_name} + GradScaler, 3 steps (one overflows)"):
            cls = getattr(ampfused, cls_name)
            gen = torch.Generator().manual_seed(7)
            fast = _awkward_params(device, torch.bfloat16, gen)
            ref = [torch.nn.Parameter(p.detach().cpu().clone()) for p in fast]
            o_fast, o_ref = cls(fast, **kw, backend=backend), cls(ref, **kw, backend="reference")
            s_fast = ampfused.GradScaler(device.type, init_scale=256.0, growth_interval=2)
            s_ref = ampfused.GradScaler("cpu", init_scale=256.0, growth_interval=2)
            for k in range(3):
                s_fast.scale(torch.ones((), device=device))
                s_ref.scale(torch.ones(()))
                for i, (p, q, spec) in enumerate(zip(fast, ref, AWKWARD_SPECS)):
                    if not spec[2]:
                        p.grad = q.grad = None
                        continue
                    g = torch.randn(p.shape, generator=gen) * 256.0
                    if k == 1 and i == 4:
                        g.view(-1)[9] = float("nan")
                    q.grad = torch.empty_like(q).copy_(g)  # in its parameter's layout, as backward makes it
                    p.grad = torch.empty_like(p).copy_(g)
                s_fast.step(o_fast)
                s_fast.update()
                s_ref.step(o_ref)
                s_ref.update()
                o_fast.zero_grad()
                o_ref.zero_grad()
                skipped = bool(o_fast.last_step_skipped)
                if skipped != (k == 1) or bool(o_ref.last_step_skipped) != (k == 1):
                    raise AssertionError(f"step {k}: skipped {skipped}, reference {bool(o_ref.last_step_skipped)}")
                assert_close(f"step {k}: last_grad_norm", o_fast.last_grad_norm.cpu(), o_ref.last_grad_norm, 1e-5, 0)
                for i, (a, b) in enumerate(zip(_masters(o_fast, fast), _masters(o_ref, ref))):
                    assert_close(f"step {k}: master[{i}]", a, b, *TWIN_TOL)
                for i, (p, m) in enumerate(zip(fast, _masters(o_fast, fast))):
                    assert_bitwise(f"step {k}: param[{i}] is its master rounded", p, m.to(p.dtype))
            if s_fast.get_scale() != s_ref.get_scale():
                raise AssertionError(f"scale {s_fast.get_scale()} vs reference {s_ref.get_scale()}")


def probe_sanitize(args) -> int:
    device = pick_device(args.device)
    rep = Report("sanitize", str(device))
    for b in usable_backends(rep, device, args.backends):
        _sanitize_ops(rep, device, b)
        _sanitize_optimizers(rep, device, b)
    sync(device)
    return rep.finish(args.json)


# ----------------------------------------------------------------------------------------------- sync-debug

def _net():
    torch = _torch()
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(48, 129), nn.GELU(), nn.Linear(129, 33), nn.LayerNorm(33))
            self.head = nn.Linear(33, 1)
            self.unused = nn.Parameter(torch.randn(17))  # never reaches the loss: its gradient stays None

        def forward(self, x):
            return self.head(self.body(x))

    return Net()


SYNC_MSG = "called a synchronizing"


def _count_syncs(caught) -> int:
    return sum(SYNC_MSG in str(w.message) for w in caught)


def _sync_debug_one(rep: Report, device, backend: str, cls_name: str, kw: dict, steps: int) -> None:
    torch = _torch()
    import ampfused
    cls = getattr(ampfused, cls_name)
    torch.manual_seed(0)
    model = _net().to(torch.bfloat16)             # built on the CPU
    twin_model = copy.deepcopy(model)
    opt = cls(model.parameters(), **kw, backend=backend)  # the optimizer first, then the move
    model.to(device)
    twin_model.to(device)
    twin = cls(twin_model.parameters(), **kw, backend="reference")
    scaler = ampfused.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
    twin_scaler = ampfused.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=torch.bfloat16)
    cuda = device.type == "cuda"
    first_step_syncs = None
    for k in range(steps):
        loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        twin_scaler.scale(torch.ones((), device=device))
        if k == 2:  # an overflow: the step is skipped and the scale backs off
            model.head.weight.grad.view(-1)[0] = float("inf")
        for p, q in zip(model.parameters(), twin_model.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        if cuda:
            # the first step after the move carries the optimizer to the device: its host syncs are counted and
            # reported; every later step must not sync at all
            mode = "warn" if k == 0 else "error"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode(mode)
                try:
                    scaler.step(opt)
                    scaler.update()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            if k == 0:
                first_step_syncs = _count_syncs(caught)
        else:
            scaler.step(opt)
            scaler.update()
        twin_scaler.step(twin)
        twin_scaler.update()
        opt.zero_grad()   # set to None, as torch.optim's default
        twin.zero_grad()
        if bool(opt.last_step_skipped) != (k == 2) or bool(twin.last_step_skipped) != (k == 2):
            raise AssertionError(f"step {k}: skipped {bool(opt.last_step_skipped)}, reference "
                                 f"{bool(twin.last_step_skipped)}, expected {k == 2}")
        assert_close(f"step {k}: last_grad_norm", opt.last_grad_norm, twin.last_grad_norm, 1e-5, 0)
    params, twin_params = list(model.parameters()), list(twin_model.parameters())
    if not all(p.device.type == device.type for p in params):
        raise AssertionError("the model is not on the device")
    for i, (p, q) in enumerate(zip(params, twin_params)):
        if p.grad is not None:
            raise AssertionError(f"param[{i}].grad is not None after zero_grad()")
        if p is model.unused:
            continue
        st = opt.state[p]
        if "master_param" not in st or st["master_param"].device.type != device.type:
            raise AssertionError(f"param[{i}]: no fp32 master on {device.type} after the move")
        assert_close(f"param[{i}] master", st["master_param"], twin.state[q]["master_param"], *TWIN_TOL)
        assert_bitwise(f"param[{i}] is its master rounded", p, st["master_param"].to(p.dtype))
    if model.unused in opt.state and opt.state[model.unused]:
        raise AssertionError("the parameter that never had a gradient has optimizer state")
    if scaler.get_scale() != twin_scaler.get_scale():
        raise AssertionError(f"scale {scaler.get_scale()} vs reference {twin_scaler.get_scale()}")
    if cuda:
        rep.metrics.setdefault("first_step_after_move_syncs", {})[f"{cls_name}/{backend}"] = first_step_syncs


def probe_sync_debug(args) -> int:
    device = pick_device(args.device)
    rep = Report("sync-debug", str(device))
    if device.type != "cuda":
        rep.note("torch.cuda.set_sync_debug_mode is CUDA-only: on the CPU the same loop runs without it")
    for b in usable_backends(rep, device, args.backends):
        for cls_name, kw in OPTIMIZERS:
            with rep.check(f"{b} {cls_name}: CPU model moved after the optimizer was built, gradients None "
                           f"between steps, scaler.step + update" + (" under sync debug 'error'"
                                                                     if device.type == "cuda" else "")):
                _sync_debug_one(rep, device, b, cls_name, kw, args.steps)
    counts = rep.metrics.get("first_step_after_move_syncs")
    if counts:
        rep.note("host syncs in the first step after the move (it carries the optimizer to the device; not "
                 "checked): " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return rep.finish(args.json)


# ---------------------------------------------------------------------------------------------------- graph

GRAPH_SPECS = [((1,), "plain", True, 0), ((127,), "plain", True, 0), ((65537,), "plain", True, 0),
               ((2, 3, 5, 7), "channels_last", True, 0), ((45, 67), "transposed", True, 0),
               ((12289,), "offset", True, 0)]


def _opt_snapshot(opt, params) -> List[Tuple[str, object]]:
    out = [(f"param[{i}]", p.detach()) for i, p in enumerate(params)]
    for i, p in enumerate(params):
        for k, v in sorted(opt.state[p].items()):
            out.append((f"state[{i}][{k}]", v))
    out += [("last_grad_norm", opt.last_grad_norm), ("last_found_inf", opt.last_found_inf)]
    return out


def _graph_one(rep: Report, device, backend: str, cls_name: str, kw: dict, with_scaler: bool,
               replays: int = 4) -> None:
    torch = _torch()
    import ampfused
    cls = getattr(ampfused, cls_name)
    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(3)
    graphed = _awkward_params(device, torch.bfloat16, gen, GRAPH_SPECS)
    eager = [torch.nn.Parameter(placed(ampfused.ops.memory_view(p.detach()), p.shape, s[1], p.dtype, device))
             for p, s in zip(graphed, GRAPH_SPECS)]
    o_g, o_e = cls(graphed, **kw, backend=backend), cls(eager, **kw, backend=backend)
    for p in graphed:  # the gradients live in fixed tensors that the graph reads
        p.grad = torch.zeros_like(p)
    for q in eager:
        q.grad = torch.zeros_like(q)
    s_g = s_e = None
    if with_scaler:
        s_g = ampfused.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
        s_e = ampfused.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
        s_g.scale(torch.ones((), device=device))
        s_e.scale(torch.ones((), device=device))

    def step(opt, scaler):
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()

    graph = None
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up away from the default stream: kernels, tables, workspaces
            for _ in range(2):
                step(o_g, s_g)
                step(o_e, s_e)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(o_g, s_g)
    else:
        for _ in range(2):
            step(o_g, s_g)
            step(o_e, s_e)
    for k in range(replays):
        new = [placed(torch.randn(math.prod(s[0]), generator=gen) * 64.0, s[0], s[1], torch.bfloat16, device)
               for s in GRAPH_SPECS]
        if k == 2:  # an overflowing replay: skipped (and the scale backs off)
            ampfused.ops.memory_view(new[2])[5] = float("nan")
        for p, g in zip(graphed, new):
            p.grad.copy_(g)
        if graph is not None:
            graph.replay()
        else:
            step(o_g, s_g)
        for q, g in zip(eager, new):
            q.grad = torch.empty_like(q).copy_(g)  # fresh tensors, as backward allocates after zero_grad()
        step(o_e, s_e)
        sync(device)
        for (name, a), (_, b) in zip(_opt_snapshot(o_g, graphed), _opt_snapshot(o_e, eager)):
            assert_bitwise(f"replay {k}: {name}", a, b)
        if bool(o_g.last_step_skipped) != (k == 2):
            raise AssertionError(f"replay {k}: last_step_skipped is {bool(o_g.last_step_skipped)}")
        if with_scaler:
            assert_bitwise(f"replay {k}: scale", s_g._scale, s_e._scale)
            assert_bitwise(f"replay {k}: growth tracker", s_g._growth_tracker, s_e._growth_tracker)
    del graph


def probe_graph(args) -> int:
    device = pick_device(args.device)
    rep = Report("graph", str(device))
    if device.type != "cuda":
        rep.note("CUDA graphs are CUDA-only: on the CPU the fixed-gradient optimizer steps eagerly instead of "
                 "replaying")
    for b in usable_backends(rep, device, args.backends):
        for cls_name, kw in OPTIMIZERS:
            for with_scaler in (False, True):
                what = "scaler.step(opt) + scaler.update()" if with_scaler else "opt.step()"
                how = ("captured and replayed 4 times" if device.type == "cuda" else
                       "run 4 times on fixed gradient tensors")
                with rep.check(f"{b} {cls_name}: {what} {how} (one overflows) equals an eager twin"):
                    _graph_one(rep, device, b, cls_name, kw, with_scaler)
    return rep.finish(args.json)


# --------------------------------------------------------------------------------------------------- counts

def _median_host_ms(fn: Callable[[], None], reps: int, before: Optional[Callable[[], None]] = None) -> float:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _counts_one(rep: Report, device, backend: str, tensors: int, numel: int, reps: int) -> List[dict]:
    torch = _torch()
    import ampfused
    from . import measure, workloads
    shapes = workloads.uniform(numel, tensors).shapes
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, device=device, generator=gen) * 0.02).to(torch.bfloat16))
              for s in shapes]
    grads = [(torch.randn(s, device=device, generator=gen) * 1e-3).to(torch.bfloat16) for s in shapes]
    for p, g in zip(params, grads):
        p.grad = g
    opt = ampfused.FusedAdamW(params, lr=1e-4, weight_decay=0.1, max_grad_norm=1.0, backend=backend)
    scaler = ampfused.GradScaler(device.type, init_scale=1.0, growth_interval=10**6)
    scaler.scale(torch.ones((), device=device))

    def plain():
        opt.step()

    def scaled():
        scaler.step(opt)
        scaler.update()

    rows = []
    cuda = device.type == "cuda"
    for path, fn in (("opt.step()", plain), ("scaler.step + update", scaled)):
        for _ in range(3):
            fn()
        sync(device)
        prof = measure.profile_step(fn, lambda: None, device)
        host = _median_host_ms(fn, reps)
        sync(device)
        gpu = measure.time_steps(fn, lambda: None, device, warmup=2, reps=reps).median

        def fresh():  # gradients set to None and handed over as new tensors, as backward does
            for p, g in zip(params, grads):
                p.grad = torch.empty_like(g).copy_(g)

        host_fresh = _median_host_ms(fn, max(5, reps // 5), before=fresh)
        for p, g in zip(params, grads):
            p.grad = g
        fn()
        sync(device)
        row = dict(tensors=tensors, numel=numel, backend=backend, path=path, kernels=prof.launches,
                   host_syncs=prof.host_syncs, host_ms=round(host, 4), host_ms_fresh_grads=round(host_fresh, 4),
                   device_ms=round(gpu, 4), replay_host_ms=None, replay_device_ms=None)
        if cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            sync(device)
            row["replay_host_ms"] = round(_median_host_ms(graph.replay, reps), 4)
            sync(device)
            row["replay_device_ms"] = round(measure.time_steps(graph.replay, lambda: None, device, warmup=2,
                                                               reps=reps).median, 4)
            del graph
        rows.append(row)
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


def counts_table(rows: List[dict]) -> List[str]:
    """Markdown table of the counts probe's rows (the driver's summary shows it)."""
    def ms(x):
        return "n/a" if x is None else f"{x:.3f}"

    out = ["| tensors | backend | step | kernels | host ms (eager) | host ms (fresh grads) | device ms (eager) "
           "| host ms (replay) | device ms (replay) |", "|" + " --- |" * 9]
    for r in rows:
        out.append(f"| {r['tensors']} | {r['backend']} | {r['path']} | "
                   f"{'n/a' if r['kernels'] is None else r['kernels']} | {ms(r['host_ms'])} | "
                   f"{ms(r['host_ms_fresh_grads'])} | {ms(r['device_ms'])} | {ms(r['replay_host_ms'])} | "
                   f"{ms(r['replay_device_ms'])} |")
    return out


def probe_counts(args) -> int:
    device = pick_device(args.device)
    rep = Report("counts", str(device))
    if device.type != "cuda":
        rep.note("on the CPU 'kernels' counts the outermost operators of a step and there is no graph replay")
    rows: List[dict] = []
    rep.metrics["rows"] = rows
    for b in usable_backends(rep, device, args.backends):
        for tensors in args.tensors:
            with rep.check(f"{b}: {args.numel} parameters in {tensors} tensors measured"):
                rows += _counts_one(rep, device, b, tensors, args.numel, args.reps)
    if rows:
        print("\n".join(counts_table(rows)))
    return rep.finish(args.json)


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


# ---------------------------------------------------------------------------------------------------- bench

def probe_bench(args, extra: List[str]) -> int:
    """``python -m bench`` with the given workloads, torch's fused recipe (and foreach with --torch-foreach),
    and every ampfused variant available on the device; torch-compile left out."""
    from . import cli
    from .ampfused_variant import ampfused_variants
    device = pick_device(args.device)
    names = (["torch-foreach"] if args.torch_foreach else []) + ["torch-fused"]
    names += [v.name for v in ampfused_variants(device)]
    argv = ["--device", str(device), "--workloads", args.workloads, "--variants", ",".join(names),
            "--out", args.out, "--name", args.name, "--no-progress"] + extra
    print("python -m bench " + " ".join(argv), flush=True)
    return cli.main(argv)


# ------------------------------------------------------------------------------------------------------ cli

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_probe", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="probe", required=True)

    def add(name, help_):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
        s.add_argument("--json", default=None, help="write the checks and measurements to this file")
        return s

    add("env", "versions, the device and its free memory")
    for name, help_ in (("sanitize", "every op and a few fused steps on awkward sizes (for compute-sanitizer)"),
                        ("sync-debug", "scaler.step + update under the sync-debug mode, model moved after build"),
                        ("graph", "fused steps captured in a CUDA graph against an eager twin"),
                        ("counts", "kernels per step, host time per step, graph replay time"),
                        ("big", "a gradient of more than 2**31 elements")):
        s = add(name, help_)
        s.add_argument("--backends", type=lambda v: [x for x in v.split(",") if x], default=None,
                       help="comma list (default: cuda,triton on a GPU; cpu on the CPU)")
        if name == "sync-debug":
            s.add_argument("--steps", type=int, default=5)
        if name == "counts":
            s.add_argument("--tensors", type=lambda v: [int(x) for x in v.split(",")], default=[200, 2000])
            s.add_argument("--numel", type=int, default=1_000_000)
            s.add_argument("--reps", type=int, default=50)
        if name == "big":
            s.add_argument("--numel", type=int, default=None, help=f"elements (default {BIG_NUMEL})")
            s.add_argument("--ops-only", action="store_true", help="only the ops, not FusedSGD (less memory)")
    s = add("bench", "python -m bench over reduced workloads (arguments after -- go to it)")
    s.add_argument("--workloads", default="1Mx200,16Mx32,gpt2-small")
    s.add_argument("--out", required=True)
    s.add_argument("--name", default="bench")
    s.add_argument("--torch-foreach", action="store_true", help="time torch's foreach recipe too")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = parser().parse_args(argv)
    if args.probe == "bench":
        return probe_bench(args, extra)
    if extra:
        raise SystemExit(f"unexpected arguments after --: {extra}")
    run = {"env": probe_env, "sanitize": probe_sanitize, "sync-debug": probe_sync_debug, "graph": probe_graph,
           "counts": probe_counts, "big": probe_big}[args.probe]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
