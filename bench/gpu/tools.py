"""What ``python -m bench.gpu`` runs its stages with: finding nvcc and compute-sanitizer, judging a
stage's output (pytest, sanitizer, probe), and running a command under a time limit into a log."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

PASS, FAIL, SKIP, TIMEOUT, PENDING = "PASS", "FAIL", "SKIP", "TIMEOUT", "PENDING"
INTERRUPT_GRACE = 8.0  # seconds before its limit a stage is interrupted (SIGINT) to print what it has
PROBE_SKIP_EXIT = 3  # what bench.gpu.probe exits with when a whole probe cannot run here


# ------------------------------------------------------------------------------------------ finding tools

def nvcc_path() -> Optional[str]:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


def sanitizer_candidates() -> List[str]:
    """Where compute-sanitizer may be: next to nvcc (also behind a wrapper script or a symlink), in
    CUDA_HOME/bin, in the toolkit nvcc reports (``nvcc --dryrun``), in /usr/local/cuda, on PATH."""
    roots: List[str] = []
    nvcc = nvcc_path()
    if nvcc:
        roots += [os.path.dirname(os.path.dirname(nvcc)), os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
        try:
            out = subprocess.run([nvcc, "--dryrun", "--version"], capture_output=True, text=True, timeout=30).stderr
            roots += [os.path.normpath(m) for m in re.findall(r"^#\$ TOP=(\S+)", out, re.M)]
        except (OSError, subprocess.SubprocessError):
            pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            roots.append(os.environ[var])
    roots.append("/usr/local/cuda")
    out: List[str] = []
    for r in roots:
        for c in (os.path.join(r, "bin", "compute-sanitizer"), os.path.join(r, "compute-sanitizer", "compute-sanitizer")):
            if c not in out:
                out.append(c)
    on_path = shutil.which("compute-sanitizer")
    if on_path and on_path not in out:
        out.append(on_path)
    return out


def find_sanitizer() -> Tuple[Optional[str], List[str]]:
    """(path of compute-sanitizer or None, the places looked at)."""
    places = sanitizer_candidates()
    for c in places:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c, places
    return None, places


def xdist_available() -> bool:
    return importlib.util.find_spec("xdist") is not None


# ------------------------------------------------------------------------------------------ judging output

_PYTEST_TAIL = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", re.M)
_PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)")


def pytest_outcome(text: str) -> Optional[str]:
    """pytest's closing counts ('2 failed, 119 passed, 3 skipped'), or None when it did not get that far."""
    found = _PYTEST_TAIL.findall(text)
    return found[-1].strip().rstrip(",") if found else None


def sanitizer_verdict(text: str, exit_code: Optional[int], tool: str) -> Tuple[str, str]:
    """(status, note) of a compute-sanitizer run: PASS only when it reported zero errors (racecheck: zero
    error hazards; warnings are counted in the note), the probe under it said ok and everything exited 0."""
    low = text.lower()
    for marker in ("device not supported", "is not supported on this", "no attachable process",
                   "unable to find injection library", "sanitizer api initialization failed"):
        if marker in low:
            line = next((ln.strip() for ln in text.splitlines() if marker in ln.lower()), marker)
            return SKIP, f"compute-sanitizer could not run here: {line}"
    errors = [int(n) for n in re.findall(r"ERROR SUMMARY:\s*(\d+) errors?", text)]
    races = [(int(h), int(e), int(w)) for h, e, w in
             re.findall(r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed\s*\((\d+) errors?,\s*(\d+) warnings?\)", text)]
    probe_ok = re.search(r"^probe sanitize: ok\b", text, re.M) is not None
    first_error = next((ln.strip() for ln in text.splitlines()
                        if ln.startswith("========= ") and ("Invalid" in ln or "Error" in ln or "Race" in ln
                                                           or "Uninitialized" in ln or "Barrier" in ln
                                                           or "Hazard" in ln)), "")
    if not errors and not races:
        return FAIL, (f"no sanitizer summary in the output (exit {exit_code})"
                      + (f"; {_last_line(text)}" if text.strip() else ""))
    n_err = sum(errors) + sum(e for _, e, _ in races)
    n_warn = sum(w for _, _, w in races)
    if n_err:
        return FAIL, f"{tool}: {n_err} error(s)" + (f"; first: {first_error}" if first_error else "")
    if not probe_ok or exit_code != 0:
        probe = _probe_line(text, "sanitize") or _last_line(text)
        return FAIL, f"{tool} reported 0 errors, but the workload did not pass (exit {exit_code}): {probe}"
    note = f"{tool}: 0 errors"
    if n_warn:
        note += f", {n_warn} racecheck warning(s) (see the log)"
    return PASS, note


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _probe_line(text: str, probe: Optional[str] = None) -> Optional[str]:
    """The closing line of a probe (``probe NAME: ...``), of any probe when ``probe`` is None."""
    name = r"[\w-]+" if probe is None else re.escape(probe)
    found = re.findall(rf"^probe {name}: .*$", text, re.M)
    return found[-1][:500] if found else None


def _exit_words(code: Optional[int]) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


# ------------------------------------------------------------------------------------------------ running

@dataclass
class Outcome:
    """What running one stage gave."""
    name: str
    title: str
    gpu: bool
    limit_s: float
    own_limit_s: float = 0.0
    status: str = PENDING
    reason: str = ""
    command: str = ""
    exit_code: Optional[int] = None
    wall_s: Optional[float] = None
    details: Dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(name=self.name, title=self.title, gpu=self.gpu, status=self.status, reason=self.reason,
                    command=self.command, exit_code=self.exit_code,
                    wall_s=None if self.wall_s is None else round(self.wall_s, 2), limit_s=round(self.limit_s, 1),
                    own_limit_s=self.own_limit_s, details=self.details)


def run_limited(cmd: Sequence[str], env: Dict[str, str], cwd: str, limit: float, log_path: str) \
        -> Tuple[Optional[int], float, bool]:
    """Run ``cmd`` in a new process group, stdout and stderr to ``log_path``. Past ``limit - INTERRUPT_GRACE``
    seconds the group gets SIGINT (pytest and Python then print where they were), and at ``limit`` SIGKILL.
    Returns (exit status or None, wall seconds, timed out)."""
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        try:
            proc = start_group(cmd, env, cwd, log)
        except OSError as e:
            log.write(f"cannot start {cmd[0]}: {e}\n".encode())
            return 127, time.monotonic() - t0, False
        soft = max(limit - INTERRUPT_GRACE, limit * 0.8)
        try:
            code = proc.wait(timeout=soft)
            _signal_group(proc, signal.SIGKILL)  # anything it left behind (workers), before the next stage
            return code, time.monotonic() - t0, False
        except subprocess.TimeoutExpired:
            pass
        stop_group(proc, grace=max(0.5, limit - (time.monotonic() - t0)))
        wall = time.monotonic() - t0
        log.flush()
        log.write(f"\n[gpu_check: stopped at {wall:.1f} s: the stage's limit is {limit:.0f} s]\n".encode())
        return proc.returncode, wall, True


def _interruptible() -> None:
    # The stage is stopped by SIGINT first, so its process must take it whatever this one does with it: an
    # ignored SIGINT is inherited across exec (a shell starts background jobs so), and so is a blocked one.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def start_group(cmd: Sequence[str], env: Dict[str, str], cwd: str, log) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new process group, SIGINT at its default, its output into ``log``."""
    return subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_interruptible)


def stop_group(proc: subprocess.Popen, grace: float) -> int:
    """SIGINT to ``proc``'s group; SIGKILL if ``proc`` has not ended ``grace`` seconds later; then SIGKILL to
    whatever of the group is left (workers, the sanitized process). Returns ``proc``'s exit status."""
    _signal_group(proc, signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
    _signal_group(proc, signal.SIGKILL)
    return proc.returncode


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
