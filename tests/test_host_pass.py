"""The fused optimizers' host pass (``ampfused._host``): one C++ pass per segment checks every parameter against
what the optimizer left (address, version counter) and writes the step's tensor table from the gradients. It
must take the step exactly where the Python path takes it (same bits), hand every change it cannot read in
place to the Python path (which follows, copies or refuses), and bump version counters as the Python path does.
"""
import copy
import math

import pytest
import torch

import ampfused
from ampfused import _native
from ampfused.ops import native_args
from ampfused.optim import _segments
from backends import cpu_backends
from oracle import assert_bitwise

needs_host = pytest.mark.skipif(_native.unavailable_reason("host") is not None,
                                reason=f"ampfused._host: {_native.unavailable_reason('host')}")
needs_cpu = pytest.mark.skipif(_native.unavailable_reason("cpu") is not None, reason="no native CPU backend")


def test_the_host_pass_is_built_here():
    """CI builds it (pip install --no-build-isolation); without it the optimizers would silently run slower."""
    assert _native.unavailable_reason("host") is None, _native.unavailable_reason("host")
    assert _native.module("host").build_info()["torch"] == torch.__version__


class _Counting:
    """ampfused._host with each scan's status counted."""

    def __init__(self, mod):
        self.mod, self.statuses = mod, []

    def scan(self, *args):
        out = self.mod.scan(*args)
        self.statuses.append(out[0])
        return out

    def bump(self, *args):
        return self.mod.bump(*args)

    def same_items(self, *args):
        return self.mod.same_items(*args)


@pytest.fixture
def counting(monkeypatch):
    mod = _native.module("host")
    spy = _Counting(mod)
    monkeypatch.setattr(_segments, "_HOST", spy)
    return spy


@pytest.fixture
def python_path(monkeypatch):
    monkeypatch.setattr(_segments, "_HOST", None)


class _ToFloat(torch.nn.Module):
    def forward(self, x):
        return x.float()  # CUDA's layer_norm takes no bf16 input with fp32 weights


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 6), _ToFloat(),
                                torch.nn.LayerNorm(6)).to(torch.bfloat16)
    model[4].float()  # a second dtype: two segments
    return model


def _train(kind, steps=6, set_to_none=True, inject_inf_at=3, backend="cpu", device="cpu", toggle=True):
    model = _model().to(device)
    if kind == "adafactor":  # a matrix laid out transposed in memory: its factors follow its logical rows
        model[2].weight = torch.nn.Parameter(model[2].weight.detach().t().contiguous().t())
    decay = [model[0].weight, model[2].weight]
    rest = [model[0].bias, model[2].bias, model[4].weight, model[4].bias]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if kind == "adamw":
        opt = ampfused.FusedAdamW(groups, lr=1e-2, max_grad_norm=1.0, backend=backend)
    elif kind == "muon":  # a split step (two passes around the iteration) beside AdamW's groups
        groups[1]["use_muon"] = False
        opt = ampfused.FusedMuon(groups, lr=1e-2, max_grad_norm=1.0, backend=backend)
    elif kind == "adafactor":
        opt = ampfused.FusedAdafactor(groups, lr=1e-2, max_grad_norm=1.0, backend=backend)
    else:
        opt = ampfused.FusedSGD(groups, lr=1e-2, momentum=0.9, nesterov=True, max_grad_norm=1.0, backend=backend)
    scaler = ampfused.GradScaler(device, init_scale=2.0 ** 8, backend=backend)
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        x = torch.randn(8, 12, generator=g).to(device=device, dtype=torch.bfloat16)
        model[2].bias.requires_grad_(s % 2 == 0 or not toggle)  # a parameter without a gradient on odd steps
        if kind == "muon":  # and a matrix without one
            model[0].weight.requires_grad_(s % 2 == 0 or not toggle)
        loss = model(x).float().pow(2).mean()
        if s == inject_inf_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=set_to_none)
    return model, opt, scaler


def _assert_same_run(a, b):
    (ma, oa, sa), (mb, ob, sb) = a, b
    for (name, p), q in zip(ma.named_parameters(), mb.parameters()):
        assert_bitwise(name, p.detach(), q.detach())
        assert sorted(oa.state[p]) == sorted(ob.state[q]), name
        for key, v in oa.state[p].items():
            assert_bitwise(f"{name} {key}", torch.as_tensor(v), torch.as_tensor(ob.state[q][key]))
    assert_bitwise("stats", oa._stats, ob._stats)
    assert sa.get_scale() == sb.get_scale()


@needs_host
@needs_cpu
@pytest.mark.parametrize("kind", ["adamw", "sgd", "adafactor", "muon"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-set-to-None", "grads-zeroed-in-place"])
def test_the_host_pass_takes_the_python_paths_step(kind, set_to_none, counting, monkeypatch):
    fast = _train(kind, set_to_none=set_to_none)
    assert counting.statuses.count(0) >= 5 * 2, counting.statuses  # the warm steps took it, both segments
    monkeypatch.setattr(_segments, "_HOST", None)
    _assert_same_run(fast, _train(kind, set_to_none=set_to_none))


@needs_host
@pytest.mark.skipif("triton" not in cpu_backends(), reason="Triton does not run here")
@pytest.mark.parametrize("kind,set_to_none", [("adamw", True), ("sgd", True), ("adafactor", True),
                                               ("adafactor", False),  # (in place: the same table, reused)
                                               ("muon", True)])
def test_the_host_pass_feeds_the_triton_kernels_as_the_python_path_does(kind, set_to_none, counting, monkeypatch):
    fast = _train(kind, steps=4, inject_inf_at=2, backend="triton", set_to_none=set_to_none)
    assert counting.statuses.count(0) >= 3 * 2, counting.statuses
    monkeypatch.setattr(_segments, "_HOST", None)
    _assert_same_run(fast, _train(kind, steps=4, inject_inf_at=2, backend="triton", set_to_none=set_to_none))


@needs_host
@pytest.mark.skipif("triton" not in cpu_backends(), reason="Triton does not run here")
def test_fresh_gradients_of_the_same_sizes_step_triton_as_the_python_path(counting, monkeypatch):
    """Every gradient a new tensor, every size the same: the plans keep their chunk lists and take new tables
    (a table uploaded alone), and the run is the Python path's bit for bit."""
    fast = _train("adamw", steps=4, inject_inf_at=2, backend="triton", toggle=False)
    monkeypatch.setattr(_segments, "_HOST", None)
    _assert_same_run(fast, _train("adamw", steps=4, inject_inf_at=2, backend="triton", toggle=False))


@needs_host
@pytest.mark.skipif("triton" not in cpu_backends(), reason="Triton does not run here")
def test_warm_table_steps_reuse_the_triton_plans(counting):
    """Steps whose tables hold the same ints (gradients refilled in place) build no new device tables; a new
    gradient tensor (another address) builds them once more."""
    from ampfused.ops import registry
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40, dtype=torch.bfloat16)) for _ in range(3)]
    opt = ampfused.FusedAdamW(params, lr=1e-3, max_grad_norm=1.0, backend="triton")
    b = registry.get_backend("triton")
    b.step_tables.clear(), b.grad_tables.clear()  # (only this test's call sites below)
    for p in params:
        p.grad = torch.randn_like(p)
    for _ in range(2):  # the Python path's step, then the first table step
        opt.step()
    builds = (b.step_tables.builds, b.grad_tables.builds)
    for _ in range(3):
        for p in params:
            p.grad.copy_(torch.randn_like(p))
        opt.step()
    assert (b.step_tables.builds, b.grad_tables.builds) == builds and counting.statuses[-3:] == [0, 0, 0]
    plans = [slot[1] for slot in b.step_tables._slots.values()] + [slot[1] for slot in b.grad_tables._slots.values()]
    params[1].grad = torch.randn_like(params[1])
    opt.step()
    assert (b.step_tables.builds, b.grad_tables.builds) == (builds[0] + 1, builds[1] + 1)
    # new addresses, the same sizes: new tables beside the chunk lists already on the device
    now = [slot[1] for slot in b.step_tables._slots.values()] + [slot[1] for slot in b.grad_tables._slots.values()]
    kept = [(old, new) for old in plans for new in now if new.chunks is old.chunks and new is not old]
    assert len(kept) == 2 and all(new.table.data_ptr() != old.table.data_ptr() for old, new in kept)


@needs_host
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("kind", ["adamw", "sgd", "adafactor", "muon"])
def test_the_host_pass_feeds_the_gpu_kernels_as_the_python_path_does(kind, backend, counting, monkeypatch):
    """On a GPU: K1 from the segments' device tables (one launch per segment) and K2 from the same cached work
    give the Python path's bits, a parameter without a gradient and an overflow step included."""
    if backend not in ampfused.ops.available_backends("cuda"):
        pytest.skip(f"backend {backend} not available on cuda")
    fast = _train(kind, steps=6, inject_inf_at=3, backend=backend, device="cuda")
    assert counting.statuses.count(0) >= 4 * 2, counting.statuses
    monkeypatch.setattr(_segments, "_HOST", None)
    _assert_same_run(fast, _train(kind, steps=6, inject_inf_at=3, backend=backend, device="cuda"))


@needs_host
@needs_cpu
def test_changes_it_cannot_read_in_place_go_to_the_python_path(counting):
    host = _native.module("host")
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16))
    opt = ampfused.FusedAdamW([w], lr=0.1, backend="cpu")
    w.grad = torch.randn_like(w)
    opt.step()
    opt.step()
    assert counting.statuses[-1] == host.OK

    with torch.no_grad():
        w.copy_(torch.full_like(w, 3.0))  # a write outside the optimizer: the master follows (Python path)
    opt.step()
    assert counting.statuses[-1] == host.PARAM_CHANGED
    assert (w.detach() - 3.0).abs().max() < 0.2 and (opt.state[w]["master_param"] - 3.0).abs().max() < 0.2
    opt.step()
    assert counting.statuses[-1] == host.OK  # back on the host pass once followed

    w.grad = torch.randn(4, 6, dtype=torch.bfloat16).t()  # strided unlike its parameter: read through a copy
    expect_grad = w.grad.contiguous()
    ref = copy.deepcopy((w, opt))
    ref[0].grad = expect_grad
    opt.step()
    assert counting.statuses[-1] == host.GRAD_IRREGULAR
    ref[1].step()
    assert_bitwise("param", w.detach(), ref[0].detach())

    w.grad = torch.randn(6, 4, dtype=torch.bfloat16).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()


@needs_host
@needs_cpu
def test_a_parameter_swapped_in_its_groups_list_is_followed(counting):
    """A group's list item replaced in place (same list, another Parameter) is not the segment's parameter: the
    step takes the Python path, which follows the swap (as torch.optim steps whatever the list holds)."""
    torch.manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16)) for _ in range(2))
    new = torch.nn.Parameter(torch.full((8,), 2.0, dtype=torch.bfloat16))
    opt = ampfused.FusedAdamW([a, b], lr=0.1, backend="cpu")
    for p in (a, b, new):
        p.grad = torch.ones_like(p)
    opt.step()
    opt.step()
    calls = len(counting.statuses)
    opt.param_groups[0]["params"][1] = new
    opt.step()
    assert len(counting.statuses) == calls  # no scan: the lists differ, the Python path ran
    assert new in opt.state and (new.detach() < 2.0).all()  # the new parameter was stepped
    opt.step()
    assert len(counting.statuses) == calls + 1 and counting.statuses[-1] == 0  # back on the host pass


@needs_host
@needs_cpu
def test_version_counters_move_as_the_python_paths_do(counting):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    opt = ampfused.FusedAdamW([a, b], lr=0.1, backend="cpu")
    a.grad = torch.ones_like(a)
    b.grad = torch.ones_like(b)
    opt.step()
    b.grad = None
    va, vb = a._version, b._version
    opt.step()
    assert counting.statuses[-1] == 0
    assert (a._version, b._version) == (va + 1, vb)  # written once; the gradless one untouched
    # autograd sees the in-place update, as with torch.optim
    y = (a * a).sum()  # saves a for backward
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@needs_host
@needs_cpu
def test_copies_keep_tables_of_their_own(counting):
    """A deep copy of (model, optimizer) trains on its own: its segments' tables are its own memory."""
    model = _model()
    opt = ampfused.FusedAdamW(model.parameters(), lr=1e-2, backend="cpu")
    x = torch.randn(4, 12).to(torch.bfloat16)
    for _ in range(2):
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
    model2, opt2 = copy.deepcopy((model, opt))
    seg, seg2 = opt._segs.segments[0], opt2._segs.segments[0]
    assert seg.table_address != seg2.table_address and seg.record_address != seg2.record_address
    for _ in range(2):  # the copy's first step sees new addresses (the Python path follows), then its own
        for m, o in ((model, opt), (model2, opt2)):
            m(x).float().sum().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert_bitwise("param", p.detach(), q.detach())
    assert counting.statuses[-2:] == [0, 0]


@needs_host
@needs_cpu
def test_the_cuda_backends_table_entries_hand_its_kernels_the_rows_of_its_list_entries(monkeypatch):
    """The CUDA backend's table entries (run on a GPU) from a host-pass table, checked here with the CUDA module
    replaced by a recorder: K1 gets the active gradients' addresses, sizes and dtype codes in table order, and the
    step's cached device work is built from exactly the rows ``step_table`` makes of the same tensors."""
    from ampfused.ops import cuda as C

    calls = []

    class Recorder:
        STEP_CHUNK, TILE, MAX_PARTIALS_PER_TENSOR, WORK_SHIFT = 4096, 1024, 64, 32
        STEP_SLOTS = _native.module("cpu").STEP_SLOTS  # (the modules share the packed call's layout)

        def step_ops(self):
            return _native.module("cpu").step_ops()

        def num_partials(self, numels):
            return sum((n + 1023) // 1024 for n in numels)

        def __getattr__(self, name):
            return lambda *args: calls.append((name, args))

    backend = C.CudaBackend()
    monkeypatch.setattr(backend, "_mod", lambda: Recorder())
    monkeypatch.setattr(backend, "_device_args", lambda device: (0, 0))
    monkeypatch.setattr(C, "_counter", lambda steps: 0)
    monkeypatch.setattr(C, "_capturing", lambda index: False)
    monkeypatch.setattr(C, "_device_index", lambda device: 0)
    monkeypatch.setattr(C, "_raw_stream", lambda index: 0)

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (3000, 5, 1500)]
    opt = ampfused.FusedAdamW(params, lr=0.1, backend="cpu")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    params[1].grad = None
    seg = opt._segs.segments[0]
    status, _, active, _, _ = _native.module("host").scan(seg.params, seg.record_address, seg.table_address, 1)
    assert (status, active) == (0, 2)
    grads = [p.grad for p in params]
    rows, _ = native_args.step_table(params, grads)
    assert seg.table.reshape(-1).tolist() == rows

    inv = torch.ones(())
    C._works.clear()
    uploads = C.stats["uploads"]
    partials = backend.norm_check_tables([(seg.table_address, len(seg), seg.dtype, seg.table)], 0, inv)
    (name, args), = calls
    work = C._works[(0, "table", seg.table_address)]
    assert name == "norm_check_work" and C.stats["uploads"] == uploads + 1
    assert work.basis == seg.table.tobytes() and work.dev[:len(rows)].tolist() == rows
    # the kernels find the work lists right after the table's ints (4 per row) in the device copy
    assert work.chunks == work.table + 8 * len(rows) and work.columns == work.chunks + 8 * work.num_chunks
    # K1's columns: partials 0..2 of row 0 (3000 elements), 0..1 of row 2 (1500); row 1 has no gradient
    columns = work.dev[len(rows) + work.num_chunks:].tolist()
    assert columns == [0, 1, 2, (2 << 32) | 0, (2 << 32) | 1] and work.num_columns == 5
    assert args == (work.table, work.columns, 5, 0, 1, inv.data_ptr(), partials.data_ptr(), 5, 0, 0)
    assert tuple(partials.shape) == (2, 5)

    calls.clear()
    backend.step(_table_call(seg, opt, partials, inv))
    (name, (op, slots, hyper)), = calls
    assert name == "step" and op == "adam_step_"
    assert C._works[(0, "table", seg.table_address)] is work  # K1's upload, reused
    # what the CUDA entry reads of it (the CPU module runs the same reader): the device work, the segment's buffers
    cpu = _native.module("cpu")
    read, by_name = cpu.read_step(op, slots, hyper), dict(zip(cpu.STEP_SLOTS, slots))
    assert (read["table"], read["count"], read["num_partials"]) == (work.table, len(seg), partials.shape[1])
    assert (read["state1"], read["state2"]) == (seg.states["exp_avg"].data_ptr(), seg.states["exp_avg_sq"].data_ptr())
    assert (by_name["chunks"], by_name["num_chunks"], by_name["columns"]) == (work.chunks, work.num_chunks,
                                                                           work.columns)
    assert read["hyper"] == dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_norm=float("inf"),
                                 decoupled=1.0, maximize=0.0)
    assert C.stats["uploads"] == uploads + 1
    assert (read["param_dtype"], read["grad_dtype"], read["master"]) == (1, 1, seg.master.data_ptr())


def _table_call(seg, opt, partials, inv):
    """An AdamW step of a segment from its host table, as the optimizer makes it."""
    from ampfused.ops.call import StepCall
    from ampfused.ops.specs import SPECS
    st = seg.states
    return StepCall(SPECS["adam_step_"], table=(seg.table_address, len(seg), seg.table), dtype=seg.dtype,
                    master=seg.master, states=dict(exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"]), steps=seg.steps,
                    partials=partials, inv_scale=inv, lr=seg.lr, out_stats=opt._stats,
                    hyper=dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_norm=float("inf"),
                               decoupled=True, maximize=False))


def _recording_cuda_backend(monkeypatch, calls: list):
    """A CUDA backend whose module is a recorder (each call appended to ``calls``) and whose uploads are copies as
    on a device, with a watch on its page-locked staging; its cached device work cleared."""
    from ampfused.ops import cuda as C
    from test_work_lists import StagingWatch

    class Recorder:
        STEP_CHUNK, TILE, MAX_PARTIALS_PER_TENSOR, WORK_SHIFT = 4096, 1024, 64, 32
        STEP_SLOTS = _native.module("cpu").STEP_SLOTS  # (the modules share the packed call's layout)

        def step_ops(self):
            return _native.module("cpu").step_ops()

        def __getattr__(self, name):
            return lambda *args: calls.append((name, args))

    backend = C.CudaBackend()
    monkeypatch.setattr(backend, "_mod", lambda: Recorder())
    monkeypatch.setattr(backend, "_device_args", lambda device: (0, 0))
    for name, fake in (("_counter", lambda steps: 0), ("_capturing", lambda index: False),
                       ("_device_index", lambda device: 0), ("_raw_stream", lambda index: 0)):
        monkeypatch.setattr(C, name, fake)
    watch = StagingWatch(monkeypatch)
    C._works.clear()
    return backend, watch


@needs_host
@needs_cpu
def test_the_cuda_backends_cached_work_keeps_no_staging_buffer(monkeypatch):
    """The CUDA backend's cached device work (its module replaced by a recorder, its upload by a copy as on a
    device) keeps no staging buffer: a changed table, in a loop whose tables change (fresh gradients), finds the
    blocks of the tables before it free once their copies are done, and allocates no page-locked memory (a call
    that CUDA may serve by synchronizing the device)."""
    from ampfused.ops import cuda as C
    backend, watch = _recording_cuda_backend(monkeypatch, [])

    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (3000, 5, 1500)]
    opt = ampfused.FusedAdamW(params, lr=0.1, backend="cpu")
    inv = torch.ones(())
    for k in range(3):
        for p in params:
            p.grad = torch.randn_like(p)  # fresh gradients: a changed table each time
        opt.step()
        seg = opt._segs.segments[0]
        partials = backend.norm_check_tables([(seg.table_address, len(seg), seg.dtype, seg.table)], 0, inv)
        backend.step(_table_call(seg, opt, partials, inv))
    assert len(watch.handed_out) == 3 and watch.kept() == 0
    work = C._works[(0, "table", seg.table_address)]
    assert work.dev[:seg.table.size].tolist() == seg.table.reshape(-1).tolist()
    C._works.clear()


@needs_host
@needs_cpu
def test_the_scan_says_what_changed_in_the_table():
    """Nothing when the tensors are those of the last scan; new addresses alone (fresh gradient tensors); sizes
    too when a gradient appears or goes (the work lists change with them). A scan that stops part-way leaves
    a table no copy may be taken for: the segment's stamps change."""
    host = _native.module("host")
    params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 3, 5)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = ampfused.FusedAdamW(params, lr=0.1, backend="cpu")
    opt.step()
    seg = opt._segs.segments[0]
    seg.table[:, :3] = 0  # as the segment was built

    def scan():
        return host.scan(seg.params, seg.record_address, seg.table_address, 1)

    assert scan()[4] == host.CHANGED_ADDRESSES | host.CHANGED_SIZES  # the first scan fills the table
    assert scan()[4] == 0
    params[1].grad = torch.randn_like(params[1])
    assert scan()[4] == host.CHANGED_ADDRESSES
    params[2].grad = None
    assert scan()[4] == host.CHANGED_ADDRESSES | host.CHANGED_SIZES
    assert scan()[4] == 0

    stamps = seg.stamps
    for p in params:
        p.grad = torch.randn_like(p)
    opt._segs.scan(opt)
    assert seg.stamps[0] != stamps[0] and seg.stamps[1] != stamps[1]  # a gradient appeared
    stamps = seg.stamps
    params[0].grad = torch.randn_like(params[0])
    opt._segs.scan(opt)
    assert seg.stamps[0] != stamps[0] and seg.stamps[1] == stamps[1]  # new addresses, the same sizes
    stamps = seg.stamps
    opt._segs.scan(opt)
    assert seg.stamps == stamps
    params[2].grad = torch.randn(10)[::2]  # strided: the scan stops at it, rows 0 and 1 written
    assert opt._segs.scan(opt) is None and seg.stamps[0] != stamps[0] and seg.stamps[1] != stamps[1]


@needs_host
@needs_cpu
def test_fresh_gradients_upload_the_table_alone_on_the_cuda_backend(monkeypatch):
    """The CUDA backend's cached work (its module replaced by a recorder, its upload by a copy as on a device)
    after fresh gradient tensors of the same sizes: a new device table, the work lists kept on the device (the
    kernels get the same chunk and column addresses); a gradient gone rebuilds the lists."""
    from ampfused.ops import cuda as C
    calls = []
    backend, watch = _recording_cuda_backend(monkeypatch, calls)
    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (9000, 5, 1500)]
    opt = ampfused.FusedAdamW(params, lr=0.1, backend="cpu")
    inv = torch.ones(())

    def step():
        opt.step()  # (the cpu backend's step: it writes the table the cuda entries read)
        seg = opt._segs.segments[0]
        calls.clear()
        backend.norm_check_tables([(seg.table_address, len(seg), seg.dtype, seg.table, seg.stamps)], 0, inv)
        work = C._works[(0, "table", seg.table_address)]
        assert calls[0][1][:3] == (work.table, work.columns, work.num_columns)
        return seg, work

    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # builds the segments (the Python path); the host pass writes the table from the next step on
    seg, first = step()
    assert first.lists is first.dev and first.num_chunks == 3 + 1 + 1 and first.num_columns == 9 + 1 + 2
    for p in params:
        p.grad = torch.randn_like(p)  # fresh tensors, the same sizes
    seg, work = step()
    assert work is not first and work.lists is first.lists and work.dev is not first.dev
    assert (work.chunks, work.columns) == (first.chunks, first.columns) and work.dev.numel() == seg.table.size
    assert work.dev.tolist() == seg.table.reshape(-1).tolist()
    uploads = C.stats["uploads"]
    assert step()[1] is work and C.stats["uploads"] == uploads  # in place: nothing uploaded
    params[1].grad = None
    seg, rebuilt = step()
    assert rebuilt.lists is rebuilt.dev and rebuilt.num_chunks == 3 + 1 and rebuilt.num_columns == 9 + 2
    assert watch.kept() == 0
    C._works.clear()


@needs_host
@needs_cpu
def test_a_factored_steps_host_table_reaches_the_cuda_backend_as_its_tensors_would(monkeypatch):
    """FusedAdafactor's host-pass table on the CUDA backend (its module a recorder, its upload a copy as on a
    device): the device table holds exactly the rows and tiles the backend makes of the same tensors (a matrix
    laid out transposed, one of three dimensions, a vector), uploaded again only when the host pass says the
    table changed (fresh gradient tensors)."""
    from ampfused.ops import cuda as C
    from ampfused.ops import native_factored as AF
    calls = []
    backend, _ = _recording_cuda_backend(monkeypatch, calls)
    C._factored_tables.clear()
    params = [torch.nn.Parameter(torch.randn(30, 40, dtype=torch.bfloat16).t()),
              torch.nn.Parameter(torch.randn(3, 4, 5, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.randn(7, dtype=torch.bfloat16))]
    opt = ampfused.FusedAdafactor(params, lr=0.1, backend="cpu")
    partials, inv = torch.zeros(2, 1), torch.ones(())

    def step():
        opt.step()  # (the cpu backend's step from the host pass's table: it writes the table the cuda backend reads)
        seg = opt._segs.segments[0]
        calls.clear()
        backend.step(opt._step_call(seg, opt.param_groups[0], partials, inv, seg.lr, math.inf,
                                    table=seg.step_table(), dtype=seg.dtype))
        (work,) = C._factored_tables.values()
        rows = AF.table(seg.tensors(), [p.grad for p in seg.params])
        assert work.rows == rows and work.table.tolist() == rows + AF.tiles(seg.tensors(), [p.grad for p in
                                                                                             seg.params])[0]
        assert [name for name, _ in calls] == ["step"]
        return work

    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # builds the segments (the Python path); the host pass writes the table from the next step on
    step()
    uploads = C.stats["uploads"]
    step()
    assert C.stats["uploads"] == uploads  # the same tensors: nothing uploaded
    for p in params:
        p.grad = torch.randn_like(p)  # fresh tensors
    step()
    assert C.stats["uploads"] == uploads + 1
    C._factored_tables.clear()


@needs_host
@pytest.mark.skipif("triton" not in cpu_backends(), reason="Triton does not run here")
def test_a_factored_steps_warm_host_table_is_not_uploaded_again_on_triton(counting):
    """FusedAdafactor on Triton with gradients written in place: the host pass's table is uploaded once, then
    reused while the host pass finds nothing changed (its stamps)."""
    backend = ampfused.ops.get_backend("triton")
    params = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(4))]
    opt = ampfused.FusedAdafactor(params, lr=0.1, backend="triton")
    for p in params:
        p.grad = torch.randn_like(p)
    builds = []
    for _ in range(4):
        opt.step()
        builds.append(backend.step_tables.builds)
        for p in params:
            p.grad.normal_()  # in place: the same tensors
    assert builds[1] == builds[0] + 1 and builds[3] == builds[1], builds  # the Python path's, the host pass's, none
    assert counting.statuses.count(0) >= 3
