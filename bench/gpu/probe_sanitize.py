"""The GPU probe's ``sanitize`` stage: every op, a few fused steps on awkward sizes and every state mode
(probe_modes.py), each checked against the reference backend, as the workload ``compute-sanitizer`` runs under (``python -m bench.gpu.probe sanitize``)."""
from __future__ import annotations

import math

from .probe_common import AWKWARD_SPECS, Report, _torch, assert_bitwise, assert_close, pick_device, placed, sync, usable_backends


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
    ("FusedLion", dict(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)),
    ("FusedAdafactor", dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)),  # cuda: a cooperative launch
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
    from .probe_modes import sanitize_modes
    device = pick_device(args.device)
    rep = Report("sanitize", str(device))
    for b in usable_backends(rep, device, args.backends):
        _sanitize_ops(rep, device, b)
        _sanitize_optimizers(rep, device, b)
        sanitize_modes(rep, device, b)
    sync(device)
    return rep.finish(args.json)
