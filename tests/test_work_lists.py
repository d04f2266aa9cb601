"""The work lists of a changed tensor table, built by one C++ pass (``ampfused._host.work_list``) into the staging
buffer its upload reads: the same items as the numpy path (the fallback where ``_host`` is not built) for every
geometry the CUDA and Triton steps use, and the Triton plans built from them unchanged."""
import numpy
import pytest
import torch

from ampfused import _native, _work

needs_host = pytest.mark.skipif(_native.unavailable_reason("host") is not None,
                                reason=f"ampfused._host: {_native.unavailable_reason('host')}")


def _table(numels, cols=4, numel_col=2):
    t = numpy.zeros((len(numels), cols), dtype=numpy.int64)
    for r, n in enumerate(numels):
        t[r] = numpy.arange(cols) * 0x1000 + 0x10 * r
        t[r, numel_col] = n
    return t


def _plain(table, numel_col, chunk, cap, shift):
    """The items written out by hand: what both paths must give."""
    out = []
    for r, n in enumerate(table[:, numel_col].tolist()):
        if n <= 0:
            continue
        for i in range(min(-(-n // chunk), cap)):
            out += [(r << shift) | i] if shift >= 0 else [r, i * chunk]
    return out


GEOMETRIES = [  # (chunk, cap, shift): CUDA chunks, CUDA K1 columns, Triton chunks
    (8, 1 << 62, 32), (4, 3, 32), (16, 1 << 62, -1), (1, 5, 20),
]
NUMELS = [5, _native.NO_GRAD, 0, 8, 9, 23, 1, 64, _native.NO_GRAD, 17, 3, 2 ** 33 + 1]


@pytest.mark.parametrize("chunk,cap,shift", GEOMETRIES)
def test_python_path_writes_the_items(chunk, cap, shift):
    if 2 ** 33 // chunk > 10 ** 6 and cap > 10 ** 6:
        numels = NUMELS[:-1]  # an uncapped 2**33-element row would be billions of items
    else:
        numels = NUMELS
    t = _table(numels)
    want = _plain(t, 2, chunk, cap, shift)
    n = _work.python_work_list(t, 2, chunk, cap, shift)
    out = numpy.full(len(want) + 3, -7, dtype=numpy.int64)
    assert _work.python_work_list(t, 2, chunk, cap, shift, out) == n == len(want) // (1 if shift >= 0 else 2)
    assert out[:len(want)].tolist() == want and out[len(want):].tolist() == [-7] * 3  # nothing past its items


@needs_host
@pytest.mark.parametrize("chunk,cap,shift", GEOMETRIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpp_builder_matches_the_python_path(chunk, cap, shift, seed):
    rng = numpy.random.default_rng(seed)
    numels = rng.choice([_native.NO_GRAD, 0, 1, chunk - 1 or 1, chunk, chunk + 1, 7 * chunk + 3], size=200)
    for cols, numel_col in ((4, 2), (3, 1)):
        t = _table(numels.tolist(), cols, numel_col)
        n = _work.python_work_list(t, numel_col, chunk, cap, shift)
        width = n * (1 if shift >= 0 else 2)
        want = numpy.zeros(width + 1, dtype=numpy.int64)
        got = numpy.zeros(width + 1, dtype=numpy.int64)
        assert _work.python_work_list(t, numel_col, chunk, cap, shift, want) == n
        assert _work.work_list(t, numel_col, chunk, cap, shift, got) == n
        assert numpy.array_equal(got, want)
        assert got[width] == 0  # writes nothing past its items


@needs_host
def test_builder_refuses_what_it_cannot_write_safely():
    t = _table([5, 9])
    with pytest.raises(ValueError, match="chunk and cap must be positive"):
        _work.work_list(t, 2, 0, 4, 32)
    with pytest.raises(ValueError, match="room for 5 items"):
        _work.work_list(t, 2, 4, 10, 32, numpy.zeros(2, dtype=numpy.int64))
    with pytest.raises(ValueError, match="C-contiguous 2-D int64"):
        _work.work_list(numpy.asfortranarray(t), 2, 4, 10, 32)


def test_no_host_module_takes_the_python_path(monkeypatch):
    t = _table(NUMELS[:-1])
    want = _plain(t, 2, 4, 1 << 62, 32)
    monkeypatch.setattr(_work, "_HOST", None)
    out = numpy.zeros(len(want), dtype=numpy.int64)
    assert _work.work_list(t, 2, 4, 1 << 62, 32, out) == len(want) and out.tolist() == want


def test_cpu_staging_is_plain_memory_and_upload_is_the_buffer():
    host, view = _work.staging(5, torch.device("cpu"))
    view[:] = numpy.arange(5)
    assert not host.is_pinned() and host.tolist() == [0, 1, 2, 3, 4]
    assert _work.upload(host, torch.device("cpu")) is host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_is_page_locked():
    host, _ = _work.staging(5, torch.device("cuda"))
    assert host.is_pinned()


def test_triton_plans_from_lists_and_arrays_agree():
    pytest.importorskip("triton")
    from ampfused.triton_kernels import _common
    t = _table([5, _native.NO_GRAD, 0, 33, 16])
    for rows in (t.reshape(-1).tolist(), t):
        plan = _common.make_plan(rows, 4, 2, (0, 1), 16, torch.device("cpu"))
        assert plan.table.tolist() == t.reshape(-1).tolist()
        assert plan.chunks.tolist() == [0, 0, 3, 0, 3, 16, 3, 32, 4, 0] and plan.num_chunks == 5
        assert plan.aligned and plan.table.untyped_storage().nbytes() == 8 * (t.size + 10 + 1)


class StagingWatch:
    """``_work.staging`` and ``_work.upload`` as on a CUDA device, seen from the CPU: every staging buffer handed
    out is watched (a weak reference), and the upload is a copy into memory of its own, as the device copy is."""

    def __init__(self, monkeypatch):
        import weakref
        self.handed_out = []
        staging = _work.staging

        def watched(n, device):
            host, view = staging(n, device)
            self.handed_out.append(weakref.ref(host))
            return host, view

        monkeypatch.setattr(_work, "staging", watched)
        monkeypatch.setattr(_work, "upload", lambda host, device: host.clone())

    def kept(self) -> int:
        import gc
        gc.collect()
        return sum(r() is not None for r in self.handed_out)


def test_a_triton_plan_keeps_no_staging_buffer(monkeypatch):
    """A staging buffer kept past its copy holds its page-locked block, so the next changed table needs a new one
    (cudaHostAlloc inside a step, a call CUDA may serve by synchronizing): the plan keeps the device copy only."""
    pytest.importorskip("triton")
    from ampfused.triton_kernels import _common
    watch = StagingWatch(monkeypatch)
    t = _table([5, _native.NO_GRAD, 0, 33, 16])
    plan = _common.make_plan(t, 4, 2, (0, 1), 16, torch.device("cpu"))
    assert len(watch.handed_out) == 1 and watch.kept() == 0
    assert plan.table.tolist() == t.reshape(-1).tolist() and plan.num_chunks == 5
