import os
import signal

import torch  # importing torch does not import triton

# Without a CUDA device the Triton kernels run on CPU tensors under the interpreter, which must be chosen
# before triton is imported anywhere. With one they run compiled, on CUDA tensors; TRITON_INTERPRET=1 set by
# hand still forces the interpreter, and AMPFUSED_TEST_NO_INTERPRET=1 keeps it off.
if not os.environ.get("AMPFUSED_TEST_NO_INTERPRET") and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import inspect  # noqa: E402

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def _interpret_device_calls_without_repatching() -> None:
    """Triton's interpreter patches ``triton.language`` (every builtin of ``tl``, ``tl.core``, ``tl.math`` and
    the tensor class, found by ``inspect.getmembers``) when a kernel launch starts, restores it when it ends, and
    patches it again, identically, at every call of a ``@triton.jit`` helper inside the kernel: half of an
    interpreted step's time in our kernels, which call small helpers per block. Here a helper's call inside a
    launch skips the repeat when the launch has patched the modules its globals name already; what runs, and so
    every result, is unchanged (an interpreter without these names is left as it is)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang, grid = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or grid is None or getattr(patch_lang, "_ampfused_tests", False):
        return
    launch = {"depth": 0, "patched": frozenset()}
    grid_call = grid.__call__

    def _patch_lang(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core))
        if launch["depth"] and langs <= launch["patched"]:
            return None  # (a helper's call: the callers ignore what it returns)
        scope = patch_lang(fn)
        if launch["depth"]:
            launch["patched"] |= langs
        return scope

    def __call__(self, *args, **kwargs):
        outer = launch["patched"]
        launch["depth"] += 1
        launch["patched"] = frozenset()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launch["depth"] -= 1
            launch["patched"] = outer

    _patch_lang._ampfused_tests = True
    interpreter._patch_lang = _patch_lang
    grid.__call__ = __call__


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_device_calls_without_repatching()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    # the longest tests (marked slow: a native build, a 500 MB listing) first, so that with pytest -n the other
    # workers take the rest meanwhile instead of one finishing them alone; otherwise the order is the files'
    items.sort(key=lambda item: "slow" not in item.keywords)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# set by pytest for each phase, and by torch's inductor for itself: before it loads each compiled module (for
# that load), and its cache folder, pinned where it first needs it
_OWN_ENV = ("PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_", "TORCHINDUCTOR_CACHE_DIR")


def _environment() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(_OWN_ENV)}


def _restore_environment(saved: dict) -> None:
    for k in set(_environment()) - set(saved):
        del os.environ[k]
    os.environ.update(saved)


def _env_diff(old: dict, new: dict) -> str:
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return ", ".join(f"{k}={old.get(k)!r} -> {new.get(k)!r}" for k in keys)


def _dist_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _destroy_group(was: bool) -> None:
    if not was and _dist_initialized():
        torch.distributed.destroy_process_group()


def _deterministic() -> tuple:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


# Process-wide state a test could leave behind for the tests after it (and for the processes they start: a
# child inherits the signal mask, an ignored SIGINT and the environment): (what, read, restore).
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGCHLD, signal.SIGPIPE)
_PROCESS_STATE = [
    *[(f"the {s.name} handler", lambda s=s: signal.getsignal(s), lambda v, s=s: signal.signal(s, v))
      for s in _SIGNALS],
    ("the blocked signals", lambda: frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
     lambda v: signal.pthread_sigmask(signal.SIG_SETMASK, v)),
    ("the environment", _environment, _restore_environment),
    ("the working directory", os.getcwd, os.chdir),
    ("torch's default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("torch's default device", lambda: str(torch.get_default_device()), torch.set_default_device),
    ("torch's thread count", torch.get_num_threads, torch.set_num_threads),
    ("autograd's grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("torch's deterministic algorithms", _deterministic,
     lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    ("the float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("a torch.distributed process group", _dist_initialized, _destroy_group),
]


@pytest.fixture(autouse=True)
def _restores_process_state(request):
    """Each test leaves the process as it found it: what it changed is put back and the test fails, naming
    what it changed (an ignored or blocked SIGINT, say, reaches every process a later test starts)."""
    before = [read() for _, read, _ in _PROCESS_STATE]
    yield
    changed = []
    for (what, read, restore), old in zip(_PROCESS_STATE, before):
        new = read()
        if new != old:
            restore(old)
            changed.append(f"{what}: " + (_env_diff(old, new) if what == "the environment" else f"{old!r} -> {new!r}"))
    if changed:
        pytest.fail(f"{request.node.nodeid} left {'; '.join(changed)} (now restored)", pytrace=False)
