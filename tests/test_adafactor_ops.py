"""``adafactor_step_`` on every backend the CPU suite runs, against the specification (reference_adafactor.py).

* The reference against torch.optim.Adafactor over several steps, within the oracle rule (tests/oracle.py): the
  fp64 reference is the oracle, torch's fp32 loop the plain implementation whose error sets the bound.
* Every backend against the reference within the oracle rule (each sums rows, columns and RMS in its own fixed
  order), and bit for bit run to run; the elementwise math is the same IEEE operations on every backend.
* Parameters of every shape torch takes: 0-d, 1-D (unfactored), 1 element, matrices of awkward shapes,
  channels-last and transposed weights (rows and columns are logical dimensions), 3-D and 4-D (leading
  dimensions a batch of matrices), empty ones (torch's loop divides by zero; the step leaves them alone).
* A skipped step changes nothing; master remainders give the fp32-master run's masters bit for bit.
"""
import math

import pytest
import torch

from ampfused import ops
from ampfused.ops import reference
from ampfused.ops.reference import memory_view, state_layout
from ampfused.ops.reference_adafactor import factor_layout, factor_views
from backends import cpu_backends
from oracle import assert_bitwise, assert_close_to_oracle

BACKENDS = [b for b in cpu_backends() if hasattr(ops.get_backend(b), "adafactor_step_")]
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

# (shape, memory layout)
PARAMS = [
    ((7, 5), "contiguous"),
    ((13,), "contiguous"),
    ((), "contiguous"),
    ((1,), "contiguous"),
    ((1, 1), "contiguous"),
    ((1, 257), "contiguous"),
    ((33, 1), "contiguous"),
    ((45, 23), "transposed"),
    ((3, 4, 5), "contiguous"),
    ((2, 3, 4, 5), "channels_last"),
]
HYPER = dict(beta2_decay=-0.8, eps=(1e-30, 1e-3), d=1.0, weight_decay=0.1)


def _make(shape, layout, dtype, values=None):
    v = torch.randn(shape) if values is None else values
    if layout == "transposed":
        return v.t().contiguous().t().to(dtype)
    if layout == "channels_last":
        return v.to(dtype).contiguous(memory_format=torch.channels_last)
    return v.to(dtype).clone()


class Run:
    """One optimizer's tensors for ``adafactor_step_`` (fp32 master for low-precision params)."""

    def __init__(self, init, layouts, dtype, master_dtype=None, state_dtype=F32, remainders=False, seed=None):
        self.params = [_make(v.shape, lay, dtype, v) for v, lay in zip(init, layouts)]
        _, total = state_layout([p.numel() for p in self.params])
        self.master = None
        if remainders:
            self.master = torch.zeros(total, dtype=torch.int16)
        elif master_dtype is not None:
            self.master = torch.zeros(total, dtype=master_dtype)
            offs, _ = state_layout([p.numel() for p in self.params])
            for o, p in zip(offs, self.params):  # the master of a parameter is its value (as the optimizer sets it)
                self.master[o:o + p.numel()] = memory_view(torch.empty_like(p, dtype=master_dtype).copy_(p))
        self.factors = torch.zeros(factor_layout([p.shape for p in self.params])[1], dtype=state_dtype)
        self.steps = torch.zeros(len(self.params))
        self.stats = torch.zeros(2)
        self.seed = seed

    def step(self, grads, backend, partials=None, max_norm=math.inf, **hyper):
        grads = [None if g is None else torch.empty_like(p).copy_(g) for p, g in zip(self.params, grads)]
        inv = torch.ones(())
        if partials is None:
            partials = reference.norm_check([g for g in grads if g is not None], inv)
        kw = dict(HYPER, **hyper)
        lr = kw.pop("lr", 1e-2)
        ops.adafactor_step_(self.params, grads, self.master, self.factors, self.steps, partials, inv,
                            torch.tensor(lr, dtype=F32), self.stats, max_norm=max_norm, seed=self.seed,
                            backend=backend, **kw)

    def weights(self):
        """The compute copies (masters, else the parameters) in fp64, logical order."""
        if self.master is None or self.master.dtype == torch.int16:
            return [p.double() for p in self.params]
        offs, _ = state_layout([p.numel() for p in self.params])
        return [self.master[o:o + p.numel()].double().as_strided(p.shape, p.stride())
                for o, p in zip(offs, self.params)]


def _grads(step, shapes, dtype=F32, none_at=None):
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(s, generator=g).to(dtype) * 0.1 for s in shapes]
    if none_at is not None:
        out[none_at] = None
    return out


def _runs():
    init = [torch.randn(s) for s, _ in PARAMS]
    layouts = [lay for _, lay in PARAMS]
    return init, layouts


def _assert_oracle(name, fast, ref32, ref64):
    for i, (a, b, c) in enumerate(zip(fast, ref32, ref64)):
        assert_close_to_oracle(f"{name}[{i}] {PARAMS[i][0]}", a, b, c)


@pytest.mark.parametrize("wd,maximize,d,lr", [(0.1, False, 1.0, 1e-2), (0.0, True, 2.0, 0.5), (0.0, False, 1.0, 1e-3)])
def test_reference_matches_torch_adafactor(wd, maximize, d, lr):
    init, layouts = _runs()
    eps = (1e-30, 1e-3)
    ours, oracle = Run(init, layouts, F32), Run(init, layouts, F64, state_dtype=F64)
    tp = [_make(v.shape, lay, F32, v).requires_grad_() for v, lay in zip(init, layouts)]
    topt = torch.optim.Adafactor(tp, lr=lr, beta2_decay=-0.8, eps=eps, d=d, weight_decay=wd, maximize=maximize)
    hyper = dict(eps=eps, d=d, weight_decay=wd, maximize=maximize, lr=lr)
    for k in range(6):
        grads = _grads(k, [s for s, _ in PARAMS], none_at=1 if k == 2 else None)
        for p, g in zip(tp, grads):
            p.grad = None if g is None else torch.empty_like(p).copy_(g)
        topt.step()
        ours.step(grads, "reference", **hyper)
        oracle.step([None if g is None else g.double() for g in grads], "reference", **hyper)
    _assert_oracle("params", ours.weights(), [p.detach() for p in tp], oracle.weights())
    offs, _ = factor_layout([p.shape for p in ours.params])
    for i, p in enumerate(tp):
        for key, v in factor_views(ours.factors, offs[i], p.shape).items():
            ref64 = factor_views(oracle.factors, offs[i], p.shape)[key]
            assert_close_to_oracle(f"{key}[{i}]", v, topt.state[p][key], ref64)
    assert ours.steps.tolist() == [6.0 if i != 1 else 5.0 for i in range(len(PARAMS))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_norm", [math.inf, 0.05])
def test_backend_matches_reference(backend, max_norm):
    init, layouts = _runs()
    fast, ref32, ref64 = Run(init, layouts, F32), Run(init, layouts, F32), Run(init, layouts, F64, state_dtype=F64)
    again = Run(init, layouts, F32)
    for k in range(4):
        grads = _grads(k, [s for s, _ in PARAMS], none_at=3 if k == 1 else None)
        fast.step(grads, backend, max_norm=max_norm)
        again.step(grads, backend, max_norm=max_norm)
        ref32.step(grads, "reference", max_norm=max_norm)
        ref64.step([None if g is None else g.double() for g in grads], "reference", max_norm=max_norm)
    _assert_oracle("params", fast.weights(), ref32.weights(), ref64.weights())
    assert_close_to_oracle("factors", fast.factors, ref32.factors, ref64.factors)
    for a, b in zip(fast.params + [fast.factors, fast.steps], again.params + [again.factors, again.steps]):
        assert_bitwise("run to run", a, b)
    assert torch.equal(fast.steps, ref32.steps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_writes_nothing(backend):
    init, layouts = _runs()
    run = Run(init, layouts, BF16, master_dtype=F32)
    run.step(_grads(0, [s for s, _ in PARAMS]), backend)
    before = [t.clone() for t in run.params + [run.master, run.factors, run.steps]]
    grads = _grads(1, [s for s, _ in PARAMS])
    grads[4].view(-1)[0] = math.nan
    run.step(grads, backend, partials=reference.norm_check(
        [torch.empty_like(p).copy_(g) for p, g in zip(run.params, grads)], torch.ones(())))
    for a, b in zip(before, run.params + [run.master, run.factors, run.steps]):
        assert_bitwise("skipped", a, b)
    assert run.stats[1].item() == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_master_remainders_are_the_fp32_master_run(backend):
    init, layouts = _runs()
    full = Run(init, layouts, BF16, master_dtype=F32)
    rem = Run(init, layouts, BF16, remainders=True)
    for k in range(3):
        grads = _grads(k, [s for s, _ in PARAMS], dtype=BF16)
        full.step(grads, backend, max_norm=0.5)
        rem.step(grads, backend, max_norm=0.5)
    from ampfused.ops import state_precision as sp
    offs, _ = state_layout([p.numel() for p in rem.params])
    for o, p, m in zip(offs, rem.params, full.weights()):
        joined = sp.join_master(memory_view(p), rem.master[o:o + p.numel()])
        assert_bitwise("master", joined, memory_view(torch.empty_like(p, dtype=F32).copy_(m)))
    assert_bitwise("factors", rem.factors, full.factors)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stochastic_rounding_stays_within_an_ulp(backend):
    init, layouts = _runs()
    full = Run(init, layouts, BF16, master_dtype=F32)
    sr = Run(init, layouts, BF16, seed=torch.tensor(7, dtype=torch.int64))
    grads = _grads(0, [s for s, _ in PARAMS], dtype=BF16)
    full.step(grads, backend)
    sr.step(grads, backend)
    for p, m in zip(sr.params, full.weights()):
        ulp = torch.finfo(BF16).eps * m.abs().clamp(min=2 ** -126) * 2
        assert bool(((p.double() - m).abs() <= ulp).all())
    assert torch.equal(sr.steps, full.steps)


@pytest.mark.parametrize("shape", [(0, 3), (5, 0), (0,)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_parameter_is_left_alone(backend, shape):
    p, q = torch.zeros(shape), torch.randn(4, 3)
    factors = torch.zeros(factor_layout([p.shape, q.shape])[1])
    steps, stats = torch.zeros(2), torch.zeros(2)
    grads = [torch.zeros(shape), torch.randn(4, 3)]
    partials = reference.norm_check(grads, torch.ones(()))
    ops.adafactor_step_([p, q], grads, None, factors, steps, partials, torch.ones(()), torch.tensor(1e-2), stats,
                        backend=backend)
    assert steps.tolist() == [1.0, 1.0]
    assert bool(torch.isfinite(q).all())


def test_input_errors_name_the_rule():
    p = torch.randn(4, 3)
    g = torch.randn(4, 3)
    one, lr, stats, steps = torch.ones(()), torch.tensor(1e-2), torch.zeros(2), torch.zeros(1)
    partials = reference.norm_check([g], one)
    factors = torch.zeros(factor_layout([p.shape])[1])
    with pytest.raises(ValueError, match="factors"):
        ops.adafactor_step_([p], [g], None, torch.zeros(12), steps, partials, one, lr, stats)
    for kw, msg in [(dict(beta2_decay=0.8), "beta2_decay should be <= 0"), (dict(d=0.5), "Clipping threshold d"),
                    (dict(eps=(-1.0, 1e-3)), "epsilon1 should be >= 0"), (dict(eps=(None, -1.0)), "epsilon2")]:
        with pytest.raises(ValueError, match=msg):
            ops.adafactor_step_([p], [g], None, factors, steps, partials, one, lr, stats, **kw)
    assert steps.item() == 0 and factors.abs().sum() == 0


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend is not built")
def test_cpu_bits_do_not_depend_on_the_thread_count():
    init, layouts = _runs()
    threads = torch.get_num_threads()
    runs = []
    try:
        for nt in (1, 3):
            torch.set_num_threads(nt)
            run = Run(init, layouts, BF16, master_dtype=F32)
            for k in range(3):
                run.step(_grads(k, [s for s, _ in PARAMS], dtype=BF16), "cpu", max_norm=0.3)
            runs.append(run)
    finally:
        torch.set_num_threads(threads)
    a, b = runs
    for x, y in zip(a.params + [a.master, a.factors, a.steps], b.params + [b.master, b.factors, b.steps]):
        assert_bitwise("1 and 3 threads", x, y)


def _decode_tiles(params, grads, tile_elems):
    """Every (parameter, batch, row) a tile of the cuda backend's layout owns and every (parameter, batch, column) a
    column item owns, found as csrc/cuda/adafactor.cu finds them (af_find, af_tile), with each tile's partials."""
    from ampfused.ops import native_factored as na
    info, num_tiles, num_items, num_colparts = na.tiles(params, grads, tile_elems)
    rows = [info[k * na.AF_INFO:(k + 1) * na.AF_INFO] for k in range(len(params) + 1)]

    def find(x, col):
        lo, hi = 0, len(params)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if rows[mid][col] <= x else (lo, mid)
        return lo

    owned, cols, parts = [], [], []
    for x in range(num_tiles):
        k = find(x, 0)
        first, band, colbase, _ = rows[k]
        local, shape = x - first, tuple(params[k].shape)
        if len(shape) > 1:
            r_, c_ = shape[-2], shape[-1]
            bands = -(-r_ // band)
            b, r0 = local // bands, (local % bands) * band
            owned += [(k, b, r) for r in range(r0, min(r_, r0 + band))]
            parts += list(range(colbase + local * c_, colbase + (local + 1) * c_))
        else:
            owned += [(k, 0, j) for j in range(local * band, min(params[k].numel(), (local + 1) * band))]
    for x in range(num_items):
        k = find(x, 3)
        local, shape = x - rows[k][3], tuple(params[k].shape)
        chunks = -(-shape[-1] // na.AF_COL_CHUNK)
        b, c0 = local // chunks, (local % chunks) * na.AF_COL_CHUNK
        cols += [(k, b, c) for c in range(c0, min(shape[-1], c0 + na.AF_COL_CHUNK))]
    return owned, cols, parts, num_colparts


@pytest.mark.parametrize("tile_elems", [1, 7, 64, 16384])
def test_cuda_tiles_cover_every_row_and_column_once(tile_elems):
    """The cuda backend's tile layout (native_factored.tiles), read as its kernel reads it: each row of every
    matrix (each element of a vector) in one tile, each column in one item, the column partials disjoint;
    parameters without a gradient in none."""
    params = [torch.zeros(s) for s, _ in PARAMS] + [torch.zeros(300, 5), torch.zeros(4, 600), torch.zeros(9)]
    grads = [torch.zeros(1) for _ in params]
    grads[1] = None
    owned, cols, parts, num_colparts = _decode_tiles(params, grads, tile_elems)
    want_rows, want_cols = [], []
    for k, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            continue
        if p.dim() > 1:
            lead = math.prod(p.shape[:-2])
            want_rows += [(k, b, r) for b in range(lead) for r in range(p.shape[-2])]
            want_cols += [(k, b, c) for b in range(lead) for c in range(p.shape[-1])]
        else:
            want_rows += [(k, 0, j) for j in range(p.numel())]
    assert sorted(owned) == sorted(want_rows) and len(set(owned)) == len(owned)
    assert sorted(cols) == sorted(want_cols) and len(set(cols)) == len(cols)
    assert sorted(parts) == list(range(num_colparts))


@pytest.mark.gpu
@pytest.mark.parametrize("backend,tile_elems", [("cuda", None), ("cuda", 16), ("triton", None)])
def test_gpu_backends_match_the_reference(backend, tile_elems, monkeypatch):
    """The CUDA kernels and the compiled Triton kernels on a GPU: within the oracle rule of the reference (run on
    the same device, fp32 and fp64), bit for bit run to run; remainders give the fp32-master run's masters bit for
    bit; stochastic rounding bit for bit run to run. ``tile_elems``: the CUDA kernel's tiles made small, so that
    every matrix is cut into several bands (and a vector into several spans)."""
    reasons = ops.registry.reasons_for(backend, torch.device("cuda"))
    if reasons:
        pytest.skip(f"the {backend} backend cannot run on this GPU: " + "; ".join(reasons))
    if tile_elems is not None:
        from ampfused.ops import native_factored
        monkeypatch.setattr(native_factored, "AF_TILE_ELEMS", tile_elems)
    init, layouts = _runs()

    def on_gpu(run):
        for name in ("master", "factors", "steps", "stats", "seed"):
            t = getattr(run, name)
            if t is not None:
                setattr(run, name, t.cuda())
        run.params = [p.cuda() for p in run.params]
        return run

    seed = dict(seed=torch.tensor(5, dtype=torch.int64))
    runs = {"fast": (Run(init, layouts, BF16, master_dtype=F32), backend),
            "again": (Run(init, layouts, BF16, master_dtype=F32), backend),
            "rem": (Run(init, layouts, BF16, remainders=True), backend),
            "sr": (Run(init, layouts, BF16, **seed), backend), "sr2": (Run(init, layouts, BF16, **seed), backend),
            "ref32": (Run(init, layouts, BF16, master_dtype=F32), "reference"),
            "ref64": (Run(init, layouts, F64, state_dtype=F64), "reference")}
    runs = {k: (on_gpu(r), b) for k, (r, b) in runs.items()}
    one = torch.ones((), device="cuda")
    for k in range(3):
        grads = [g.cuda() for g in _grads(k, [s for s, _ in PARAMS], dtype=BF16)]
        for name, (run, b) in runs.items():
            g = [torch.empty_like(p).copy_(x) for p, x in zip(run.params, grads)]
            partials = reference.norm_check([x.float() for x in grads], one)  # one clip coefficient for all
            ops.adafactor_step_(run.params, g, run.master, run.factors, run.steps, partials, one,
                                torch.tensor(1e-2, device="cuda"), run.stats, max_norm=0.5, seed=run.seed,
                                backend=b, **HYPER)
    r = {k: v[0] for k, v in runs.items()}
    for a, b in zip(r["fast"].params + [r["fast"].factors], r["again"].params + [r["again"].factors]):
        assert_bitwise("run to run", a, b)
    for a, b in zip(r["sr"].params, r["sr2"].params):
        assert_bitwise("stochastic rounding run to run", a, b)
    _assert_oracle("params", r["fast"].weights(), r["ref32"].weights(), r["ref64"].weights())
    assert_close_to_oracle("factors", r["fast"].factors, r["ref32"].factors, r["ref64"].factors)
    from ampfused.ops import state_precision as sp
    offs, _ = state_layout([p.numel() for p in r["rem"].params])
    for o, p, m in zip(offs, r["rem"].params, r["fast"].weights()):
        joined = sp.join_master(memory_view(p), r["rem"].master[o:o + p.numel()])
        assert_bitwise("remainders", joined, memory_view(torch.empty_like(p, dtype=F32).copy_(m)))


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_native_modules_read_the_table_python_writes(kind):
    from ampfused import _native
    from ampfused.ops import native_factored
    if _native.unavailable_reason(kind):
        pytest.skip(f"ampfused's {kind} module is not built: {_native.unavailable_reason(kind)}")
    assert _native.module(kind).step_constants()["AF_COLS"] == native_factored.AF_COLS
    p = torch.zeros(2, 3, 4).permute(2, 0, 1)
    row = native_factored.table([p], [None])
    assert len(row) == native_factored.AF_COLS and row[2] == _native.NO_GRAD and row[5] == 3
    assert row[6:9] == [4, 2, 3] and row[14:17] == list(p.stride())


def test_cuda_backend_passes_its_module_the_table_tiles_and_scratch(monkeypatch):
    """Without a GPU: the cuda backend's Adafactor call (its module replaced by a recorder) packs the call as the
    built module reads it (its slots, the hyperparameters its entry declares), and uploads the table rows followed
    by the tile layout, with scratch for the column partials and three sums per tile; the upload is reused while
    the table holds."""
    from ampfused import _native
    from ampfused.ops import cuda as C
    from ampfused.ops import native_factored as na
    from test_host_pass import _recording_cuda_backend
    if _native.unavailable_reason("cuda"):
        pytest.skip(f"ampfused's cuda module is not built: {_native.unavailable_reason('cuda')}")
    mod = _native.module("cuda")
    declared = len(mod.step_ops()["adafactor_step_"])
    calls = []
    backend, _ = _recording_cuda_backend(monkeypatch, calls)
    C._factored_tables.clear()
    params = [torch.zeros(40, 30), torch.zeros(17)]
    grads = [torch.randn(40, 30), torch.randn(17)]
    factors = torch.zeros(factor_layout([p.shape for p in params])[1])
    steps, stats, one, lr = torch.zeros(2), torch.zeros(2), torch.ones(()), torch.tensor(1e-2)
    partials = reference.norm_check(grads, one)
    monkeypatch.setattr(na, "AF_TILE_ELEMS", 256)
    for _ in range(2):
        backend.adafactor_step_(params, grads, None, factors, steps, partials, one, lr, stats, -0.8, None, 1e-3, 1.0,
                                0.0, math.inf)
    assert [(name, args[0]) for name, args in calls] == [("step", "adafactor_step_")] * 2
    assert calls[0][1] == calls[1][1]
    _, slots, hyper = calls[0][1]
    assert len(slots) == len(mod.STEP_SLOTS) and len(hyper) == declared
    at = dict(zip(mod.STEP_SLOTS, slots))
    (work,) = C._factored_tables.values()
    info, num_tiles, num_items, num_colparts = na.tiles(params, grads, 256)
    rows = na.table(params, grads)
    assert work.table.tolist() == rows + info and at["table"] == work.table.data_ptr()
    assert (num_tiles, num_items, num_colparts) == (5 + 1, 1, 5 * 30)  # bands of 8 rows; one span of the vector
    assert (at["tiles"], at["items"], at["colparts"], at["scratch"], at["col_chunk"]) == (
        num_tiles, num_items, num_colparts, work.scratch.data_ptr(), na.AF_COL_CHUNK)
    assert work.scratch.dtype == torch.float64 and work.scratch.numel() == num_colparts + 3 * num_tiles
    scratch = work.scratch
    backend.adafactor_step_(params, [g.clone() for g in grads], None, factors, steps, partials, one, lr, stats,
                            -0.8, None, 1e-3, 1.0, 0.0, math.inf)  # fresh gradient tensors: a new table, same layout
    (again,) = C._factored_tables.values()
    assert again is work and work.scratch is scratch
    assert dict(zip(mod.STEP_SLOTS, calls[-1][1][1]))["table"] == work.table.data_ptr()
    assert work.table.tolist()[:len(rows)] != rows
    backend.adafactor_step_(params, [grads[0], None], None, factors, steps, partials, one, lr, stats, -0.8, None,
                            1e-3, 1.0, 0.0, math.inf)  # a parameter without a gradient: another layout
    (other,) = C._factored_tables.values()
    assert other is not work and other.num_tiles == 5
    C._factored_tables.clear()
