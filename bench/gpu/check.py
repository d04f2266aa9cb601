"""``python -m bench.gpu OUT_DIR``: validate ampfused on a GPU machine in one command.

Builds the CUDA extension from this checkout with the installed torch and triton (no network), prints
``python -m ampfused.info``, runs the test suite (the GPU-marked tests first), ``compute-sanitizer``
(memcheck, racecheck, synccheck, initcheck) over a short workload of every op, the sync-debug check, the CUDA
graph capture check, the launch and host-time counts, the buffer of more than 2**31 elements and the
benchmark. Each stage runs in its own process group with its own time limit, and the run goes on past a
stage that fails or times out. Without a CUDA device every GPU stage is reported as skipped, with the reason.

What it writes to OUT_DIR (and nothing else there; at most 7 files, so a machine that returns at most 8
files returns all of them):

  summary.md      one row per stage: PASS / FAIL / SKIP / TIMEOUT, exit status, wall time, limit, the
                  reason or what was found; the launch and host-time table; the benchmark's table
  summary.json    the same, machine-readable, with each probe's checks and measurements
  gpu_check.log   every stage's command and its whole output (stdout and stderr), one section per stage
  bench.csv, bench.txt, bench.png   the benchmark's results (only when the benchmark ran)
  loop.txt        the default training loop's table (python -m bench.step.loop; only when that stage ran)

The summary and the log are rewritten after every stage, so a run cut short still leaves what it did.
Exit status: 0 when no stage failed or timed out (skips allowed), 1 otherwise, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .parts import PARTS
from .tools import (FAIL, PASS, PENDING, PROBE_SKIP_EXIT, SKIP, TIMEOUT, Outcome, _exit_words, _last_line,
                              _probe_line, find_sanitizer, pytest_outcome, run_limited, sanitizer_verdict,
                              xdist_available)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUMMARY_MD, SUMMARY_JSON, LOG = "summary.md", "summary.json", "gpu_check.log"
BENCH_STEM = "bench"
LOOP_TXT = "loop.txt"
OUTPUT_FILES = (SUMMARY_MD, SUMMARY_JSON, LOG, f"{BENCH_STEM}.csv", f"{BENCH_STEM}.txt", f"{BENCH_STEM}.png", LOOP_TXT)
DEFAULT_BUDGET = 575.0  # seconds: the whole run, inside one 10-minute command
DEFAULT_WORKLOADS = "16Mx32,gpt2-small"
NO_WAIT_TESTS = "tests/test_gpu_nowait.py"
NO_WAIT_WORKERS = 4  # each of its checks waits out a 2 s device sleep: processes of their own overlap the waits
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# The kernels the per-access tools instrument and check: ampfused's CUDA kernels (namespace ampfused) and its
# Triton kernels (their entry points' names), not every kernel torch loads too (an H200 run of memcheck over this
# Python workload gave no result in 120 s, where initcheck ran). initcheck checks them all, since it must see
# every kernel's writes to know what memory is initialized.
# compute-sanitizer filters (key=value; regex= is matched against the mangled name): the CUDA backend's kernels
# (namespace ampfused) and the Triton kernels' entry points
SANITIZED_KERNELS = ("regex=ampfused", "regex=_(adam|sgd|lion|adafactor|norm_check|update_scale)_kernel")
LOG_SECTION_LIMIT = 1 << 20  # bytes of one stage's output kept in the combined log (head and tail)


@dataclass
class Stage:
    """One stage of the run; ``gpu`` stages need a CUDA device (reported SKIP without one)."""
    name: str
    title: str
    limit: float
    gpu: bool
    groups: Tuple[str, ...] = ()


STAGES: List[Stage] = [
    Stage("env", "versions, the device, its free memory", 15, False),
    Stage("build", "setup.py build_ext --inplace (incremental), then pip install -e . of the Python package", 120,
          False),
    Stage("info", "python -m ampfused.info", 15, False),
    Stage("suite-gpu", "pytest -m gpu: the GPU-marked tests", 80, True, ("suite",)),
    Stage("suite-rest", "pytest -m 'not gpu': the rest of the suite", 125, False, ("suite",)),
    Stage("no-wait", "pytest tests/test_gpu_nowait.py: a device sleep queued before each step outlasts it", 45, True,
          ("probes",)),
    Stage("sanitizer-memcheck", "compute-sanitizer memcheck over the op workload", 40, True, ("sanitizer",)),
    Stage("sanitizer-racecheck", "compute-sanitizer racecheck over the op workload", 40, True, ("sanitizer",)),
    Stage("sanitizer-synccheck", "compute-sanitizer synccheck over the op workload", 15, True, ("sanitizer",)),
    Stage("sanitizer-initcheck", "compute-sanitizer initcheck over the op workload", 20, True, ("sanitizer",)),
    Stage("sync-debug", "scaler.step + update under sync debug 'error', model moved after the optimizer", 15, True,
          ("probes",)),
    Stage("graph-capture", "opt.step() and the scaler path captured in a CUDA graph vs eager, bitwise", 15, True,
          ("probes",)),
    Stage("launch-counts", "kernels per step, host time per step, graph replay time (reported)", 15, True,
          ("probes",)),
    Stage("big-buffer", "a gradient of 2**31 + 17 elements on each backend", 15, True, ("probes",)),
    Stage("bench", "python -m bench over reduced workloads, torch-compile left out", 25, True),
    Stage("loop", "python -m bench.step.loop: the step inside the default training loop, torch vs ampfused", 25, True),
]
STAGE_NAMES = [s.name for s in STAGES]


class Run:
    """One run of the check: the stages' outcomes, the output directory and the work directory."""

    def __init__(self, args) -> None:
        self.args = args
        self.out = os.path.abspath(args.out_dir)
        os.makedirs(self.out, exist_ok=True)
        for name in OUTPUT_FILES:  # a previous run's files would be taken for this one's
            path = os.path.join(self.out, name)
            if os.path.isfile(path):
                os.remove(path)
        self.work = tempfile.mkdtemp(prefix="ampfused-gpu-check-")
        self.python = args.python or sys.executable
        self.t0 = time.monotonic()
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        if args.budget is None:
            args.budget = DEFAULT_BUDGET
        self.deadline = self.t0 + args.budget
        self.limits = {s.name: float(s.limit) for s in STAGES}
        self.limits.update(args.limit)
        self.outcomes = [Outcome(s.name, s.title, s.gpu, self.limits[s.name], self.limits[s.name]) for s in STAGES]
        self.env_info: Dict[str, object] = {}
        self.cuda: Optional[bool] = None
        self.cuda_reason = ""
        self.sanitizer, self.sanitizer_places = find_sanitizer()
        self.log_sections: List[bytes] = []
        self.base_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
                             PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
        self.base_env.pop("TRITON_INTERPRET", None)  # compiled kernels on a GPU; the suite decides without one

    # ---- bookkeeping
    def outcome(self, name: str) -> Outcome:
        return next(o for o in self.outcomes if o.name == name)

    def selected(self, stage: Stage) -> Tuple[bool, str]:
        names = {stage.name, *stage.groups}
        if self.args.only and not names & set(self.args.only):
            return False, f"not selected (--only {','.join(self.args.only)})"
        if names & set(self.args.skip):
            return False, f"--skip {','.join(sorted(names & set(self.args.skip)))} given"
        return True, ""

    def probe_json(self, name: str) -> str:
        return os.path.join(self.work, f"{name}.json")

    # ---- stages
    def command_for(self, stage: Stage) -> Tuple[Optional[List[str]], Dict[str, str], str]:
        """(command, extra environment, reason it cannot run) of a stage."""
        py, a = self.python, self.args
        probe = [py, "-m", "bench.gpu.probe"]
        dev = ["--device", "cuda"]
        if stage.name == "env":
            return probe + ["env", "--json", self.probe_json("env")], {}, ""
        if stage.name == "build":
            # the native modules in place, in build/ (ninja: a later part on the same machine rebuilds nothing),
            # then the package installed editable without building them again (it maps ampfused.triton_kernels)
            env = {"AMPFUSED_CUDA_ARCHS": a.archs or self.default_archs(), "MAX_JOBS": str(a.jobs)}
            q = shlex.quote(py)
            return ["sh", "-c", f"{q} setup.py build_ext --inplace && AMPFUSED_SKIP_NATIVE_BUILD=1 {q} -m pip install "
                                "-q --no-build-isolation --no-deps --no-index -e ."], env, ""
        if stage.name == "info":
            return [py, "-m", "ampfused.info"], {}, ""
        if stage.name in ("suite-gpu", "suite-rest"):
            cmd = [py, "-m", "pytest", "-q", "-rfEs", "--durations=10", "-p", "no:cacheprovider",
                   "-m", "gpu" if stage.name == "suite-gpu" else "not gpu"]
            workers = a.gpu_workers if stage.name == "suite-gpu" else a.workers
            env = {}
            if workers > 1 and xdist_available():
                cmd += ["-n", str(workers)]
                env = threads_env(workers)
            if stage.name == "suite-gpu":  # the no-wait tests are a stage of their own
                cmd += [f"--ignore={NO_WAIT_TESTS}"]
            return cmd + ["tests"], env, ""
        if stage.name == "no-wait":
            cmd = [py, "-m", "pytest", "-q", "-rfEs", "-s", "-p", "no:cacheprovider"]
            if xdist_available():
                return cmd + ["-n", str(NO_WAIT_WORKERS), NO_WAIT_TESTS], threads_env(NO_WAIT_WORKERS), ""
            return cmd + [NO_WAIT_TESTS], {}, ""
        if stage.name.startswith("sanitizer-"):
            tool = stage.name.split("-", 1)[1]
            if self.sanitizer is None:
                return None, {}, ("compute-sanitizer not found (looked for " + ", ".join(self.sanitizer_places)
                                  + ")")
            env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"} if tool in ("memcheck", "initcheck") else {}
            return sanitizer_command(self.sanitizer, tool) + probe + ["sanitize"] + dev + \
                ["--json", self.probe_json(stage.name)], env, ""
        probe_name = {"sync-debug": "sync-debug", "graph-capture": "graph", "launch-counts": "counts",
                      "big-buffer": "big"}.get(stage.name)
        if probe_name:
            return probe + [probe_name] + dev + ["--json", self.probe_json(stage.name)], {}, ""
        if stage.name == "loop":
            return [py, "-m", "bench.step.loop", "--device", "cuda", "--out", os.path.join(self.out, LOOP_TXT)], {}, ""
        if stage.name == "bench":
            return probe + ["bench"] + dev + ["--out", self.out, "--name", BENCH_STEM, "--workloads", a.workloads] + \
                (["--"] + a.bench_args if a.bench_args else []), {}, ""
        raise AssertionError(stage.name)

    def default_archs(self) -> str:
        cap = self.env_info.get("capability")
        return str(cap) if cap else "80;90"

    def judge(self, stage: Stage, o: Outcome, text: str, timed_out: bool) -> None:
        code = o.exit_code
        if timed_out:
            o.status = TIMEOUT
            extra = ""
            if stage.name.startswith("suite") or stage.name == "no-wait":
                got = pytest_outcome(text)
                extra = f"; pytest's counts when interrupted: {got}" if got else ""
            o.reason = f"stopped at its limit of {o.limit_s:.0f} s{extra}"
            return
        if stage.name == "env":
            data = self.read_probe("env")
            o.details = data.get("metrics", {}) if data else {}
            o.status = PASS if code == 0 and data else FAIL
            o.reason = ("" if o.status == PASS else f"{_exit_words(code)}: {_last_line(text)}")
            if o.status == PASS:
                d = o.details
                o.reason = (f"torch {d.get('torch')} (CUDA {d.get('torch_cuda')}), triton {d.get('triton')}; "
                            + (f"{d.get('device')} sm_{d.get('capability')}, {d.get('free_gib')} of "
                               f"{d.get('memory_gib')} GiB free" if d.get("cuda_available") else "no CUDA device"))
            return
        if stage.name == "build":
            lines = [ln.strip() for ln in re.findall(r"^\s*ampfused: ampfused\._C\w*: .*$", text, re.M)]
            o.details = {"modules": lines}
            if code != 0:
                o.status, o.reason = FAIL, f"{_exit_words(code)}: " + (
                    next((ln for ln in text.splitlines() if "error" in ln.lower()), _last_line(text))[:400])
                return
            cuda_line = next((ln for ln in lines if "_C_cuda:" in ln), "")
            if self.cuda and "_C_cuda: built" not in cuda_line:
                o.status = FAIL
                o.reason = "the build succeeded but the CUDA backend was not built: " + (cuda_line or "no build line")
                return
            o.status, o.reason = PASS, "; ".join(ln.replace("ampfused: ", "") for ln in lines) or "installed"
            return
        if stage.name == "info":
            dispatch = re.findall(r"^\s*dispatch on \w+: .*$", text, re.M)
            not_usable = re.findall(r"^\s*ampfused\._C\w*: not usable: .*$", text, re.M)
            o.details = {"dispatch": [d.strip() for d in dispatch], "not_usable": [n.strip() for n in not_usable]}
            if code != 0:
                o.status, o.reason = FAIL, f"{_exit_words(code)}: {_last_line(text)}"
            elif self.cuda and not any(d.strip() == "dispatch on cuda: cuda" for d in dispatch):
                o.status = FAIL
                o.reason = "the cuda backend does not run here: " + "; ".join(d.strip() for d in dispatch + not_usable)
            else:
                o.status, o.reason = PASS, "; ".join(d.strip() for d in dispatch)
            return
        if stage.name.startswith("suite") or stage.name == "no-wait":
            got = pytest_outcome(text)
            o.details = {"pytest": got}
            if stage.name == "no-wait":
                o.details["reported"] = re.findall(r"^\[no-wait\] .*$", text, re.M)
            if code == 0:
                o.status, o.reason = PASS, got or "pytest exited 0"
            elif code == 5:
                o.status, o.reason = FAIL, "pytest collected no tests"
            else:
                o.status = FAIL
                o.reason = (got or f"pytest {_exit_words(code)} before its summary") + (
                    "" if code == 1 else f" ({_exit_words(code)})")
            return
        if stage.name.startswith("sanitizer-"):
            o.status, o.reason = sanitizer_verdict(text, code, stage.name.split("-", 1)[1])
            data = self.read_probe(stage.name)
            if data:
                o.details = {"probe": data.get("summary"), "failed_checks": _failed(data)}
            return
        if stage.name == "loop":
            ok = code == 0 and os.path.isfile(os.path.join(self.out, LOOP_TXT))
            o.status = PASS if ok else FAIL
            o.reason = f"wrote {LOOP_TXT}" if ok else f"{_exit_words(code)}: {_last_line(text)}"
            return
        if stage.name == "bench":
            csv = os.path.join(self.out, f"{BENCH_STEM}.csv")
            if code == 0 and os.path.isfile(csv):
                o.status, o.reason = PASS, f"wrote {BENCH_STEM}.csv, .txt, .png"
            else:
                o.status = FAIL
                o.reason = f"{_exit_words(code)}: " + next(
                    (ln.strip() for ln in text.splitlines() if "benchmark stopped" in ln or "FAILED" in ln),
                    _last_line(text))
            return
        # the probes
        data = self.read_probe(stage.name)
        if data:
            o.details = {k: data.get(k) for k in ("summary", "metrics", "notes")}
            o.details["failed_checks"] = _failed(data)
            o.details["checks"] = [c["name"] for c in data.get("checks", [])]
        if code == PROBE_SKIP_EXIT and data and data.get("status") == "skip":
            o.status, o.reason = SKIP, str(data.get("reason"))
        elif code == 0 and data and data.get("status") == "ok":
            o.status = PASS
            o.reason = data.get("summary", "") + "".join(f"; {n}" for n in data.get("notes", []))
        else:
            o.status = FAIL
            failed = _failed(data) if data else []
            o.reason = (f"{_exit_words(code)}: " + ("; ".join(failed[:5]) if failed else
                                                   (_probe_line(text) or _last_line(text))))

    def read_probe(self, name: str) -> Optional[dict]:
        try:
            with open(self.probe_json(name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def gpu_skip_reason(self) -> str:
        if self.args.no_gpu:
            return "--no-gpu given"
        if self.cuda is None:
            return "CUDA availability unknown: the env stage did not run or failed"
        return self.cuda_reason or "no CUDA device (torch.cuda.is_available() is False)"

    def run_stage(self, index: int, stage: Stage) -> None:
        o = self.outcomes[index]
        ok, why = self.selected(stage)
        if ok and stage.gpu and (self.args.no_gpu or not self.cuda):
            ok, why = False, self.gpu_skip_reason()
        cmd, extra_env, cannot = (None, {}, "")
        if ok:
            cmd, extra_env, cannot = self.command_for(stage)
            if cmd is None:
                ok, why = False, cannot
        remaining = self.deadline - time.monotonic()
        if ok and remaining < min(10.0, o.limit_s):
            ok, why = False, f"the run's budget of {self.args.budget:.0f} s was spent before this stage"
        if not ok:
            o.status, o.reason = SKIP, why
            self.add_log(index, o, b"")
            self.announce(index, o)
            return
        o.limit_s = self.effective_limit(index, remaining)
        env = dict(self.base_env, **extra_env)
        shown_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra_env.items())
        o.command = (shown_env + " " if shown_env else "") + " ".join(shlex.quote(c) for c in cmd)
        print(f"[{index + 1}/{len(STAGES)}] {stage.name}: {o.command}", flush=True)
        log_path = os.path.join(self.work, f"{stage.name}.log")
        o.exit_code, o.wall_s, timed_out = run_limited(cmd, env, REPO, o.limit_s, log_path)
        with open(log_path, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8", "replace")
        try:
            self.judge(stage, o, text, timed_out)
        except Exception as e:  # noqa: BLE001 - a judging bug must not stop the run
            o.status, o.reason = FAIL, f"could not judge the output: {type(e).__name__}: {e}"
        if stage.name == "env":
            self.env_info = o.details
            if o.status == PASS:
                self.cuda = bool(self.env_info.get("cuda_available"))
                if not self.cuda:
                    self.cuda_reason = "no CUDA device (torch.cuda.is_available() is False)"
        self.add_log(index, o, raw)
        self.announce(index, o)

    def will_run(self, stage: Stage) -> bool:
        """Whether a stage is expected to run (a GPU stage counts as such while CUDA is not known to be absent)."""
        return self.selected(stage)[0] and not (stage.gpu and (self.args.no_gpu or self.cuda is False))

    def effective_limit(self, index: int, remaining: float) -> float:
        """The stage's own limit, plus what earlier stages left unused of theirs (unless --no-rollover), while
        every later stage that will run keeps its own limit; never more than the budget has left."""
        own = self.limits[STAGES[index].name]
        if self.args.no_rollover:
            return min(own, remaining)
        reserve = sum(self.limits[s.name] for s in STAGES[index + 1:] if self.will_run(s))
        return min(remaining, max(own, remaining - reserve))

    def announce(self, index: int, o: Outcome) -> None:
        took = "" if o.wall_s is None else f" in {o.wall_s:.1f} s"
        print(f"[{index + 1}/{len(STAGES)}] {o.name}: {o.status}{took}" + (f" - {o.reason}" if o.reason else ""),
              flush=True)
        self.write()

    # ---- output
    def add_log(self, index: int, o: Outcome, raw: bytes) -> None:
        head = (f"{'=' * 100}\n[{index + 1}/{len(STAGES)}] {o.name}: {o.status}"
                + (f" ({_exit_words(o.exit_code)}, {o.wall_s:.1f} s of a {o.limit_s:.0f} s limit)"
                   if o.wall_s is not None else "")
                + (f"\n{o.reason}" if o.reason else "")
                + (f"\n$ cd {REPO} && {o.command}" if o.command else "") + f"\n{'-' * 100}\n").encode()
        if len(raw) > LOG_SECTION_LIMIT:
            keep_head, keep_tail = LOG_SECTION_LIMIT // 4, LOG_SECTION_LIMIT - LOG_SECTION_LIMIT // 4
            raw = (raw[:keep_head] + f"\n[... {len(raw) - LOG_SECTION_LIMIT} bytes left out ...]\n".encode()
                   + raw[-keep_tail:])
        self.log_sections.append(head + raw + (b"" if raw.endswith(b"\n") or not raw else b"\n"))

    def overall(self) -> Tuple[str, Dict[str, int]]:
        counts = {s: sum(o.status == s for o in self.outcomes) for s in (PASS, FAIL, TIMEOUT, SKIP, PENDING)}
        if counts[FAIL] or counts[TIMEOUT]:
            return FAIL, counts
        if counts[PENDING]:
            return "INCOMPLETE", counts
        return (PASS if not counts[SKIP] else "PASS with skips"), counts

    def write(self) -> None:
        overall, counts = self.overall()
        now = time.monotonic()
        data = dict(tool="python -m bench.gpu", started=self.started, elapsed_s=round(now - self.t0, 1),
                    budget_s=self.args.budget, overall=overall, counts=counts, commit=_git_commit(),
                    cuda=self.cuda, gpu_skip_reason=None if self.cuda else self.gpu_skip_reason(),
                    environment=self.env_info, sanitizer=self.sanitizer,
                    stages=[o.as_dict() for o in self.outcomes], files=self.files())
        _write_atomic(os.path.join(self.out, SUMMARY_JSON), json.dumps(data, indent=1, default=str) + "\n")
        _write_atomic(os.path.join(self.out, SUMMARY_MD), self.markdown(overall, counts, now))
        with open(os.path.join(self.out, LOG), "wb") as f:
            f.write(b"".join(self.log_sections))

    def files(self) -> List[str]:
        return [n for n in OUTPUT_FILES if os.path.isfile(os.path.join(self.out, n)) or n in
                (SUMMARY_MD, SUMMARY_JSON, LOG)]

    def markdown(self, overall: str, counts: Dict[str, int], now: float) -> str:
        e = self.env_info
        device = (f"{e.get('device')} (sm_{e.get('capability')}, {e.get('memory_gib')} GiB)"
                  if self.cuda and not self.args.no_gpu else f"GPU stages skipped: {self.gpu_skip_reason()}")
        lines = ["# ampfused GPU check", "",
                 f"- commit {_git_commit()}; started {self.started}; took {now - self.t0:.0f} s of a "
                 f"{self.args.budget:.0f} s budget",
                 f"- {device}; torch {e.get('torch', '?')} (CUDA {e.get('torch_cuda', '?')}), triton "
                 f"{e.get('triton', '?')}, python {e.get('python', '?')}",
                 f"- compute-sanitizer: {self.sanitizer or 'not found'}",
                 f"- **overall: {overall}** ({', '.join(f'{v} {k}' for k, v in counts.items() if v)})", "",
                 "| # | stage | status | time | limit | exit | what it found |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for i, o in enumerate(self.outcomes):
            took = "" if o.wall_s is None else f"{o.wall_s:.1f} s"
            exit_ = "" if o.exit_code is None else str(o.exit_code)
            lines.append(f"| {i + 1} | {o.name} | {o.status} | {took} | {o.limit_s:.0f} s | {exit_} | "
                         f"{_md_cell(o.reason)} |")
        counts_rows = (self.outcome("launch-counts").details.get("metrics") or {}).get("rows") \
            if isinstance(self.outcome("launch-counts").details.get("metrics"), dict) else None
        if counts_rows:
            from .probe import counts_table
            lines += ["", "## Launches and host time per step (reported, not asserted)", "",
                      "FusedAdamW (bf16 parameters, fp32 masters, clipping), 1M parameters; medians. 'fresh grads': "
                      "the gradients set to None and handed over as new tensors before each step.", ""]
            lines += counts_table(counts_rows)
        syncs = (self.outcome("sync-debug").details.get("metrics") or {}) \
            if isinstance(self.outcome("sync-debug").details.get("metrics"), dict) else {}
        if syncs.get("first_step_after_move_syncs"):
            lines += ["", "## Host syncs of the first step after the model moved (reported, not asserted)", ""]
            lines += [f"- {k}: {v}" for k, v in syncs["first_step_after_move_syncs"].items()]
        bench_txt = os.path.join(self.out, f"{BENCH_STEM}.txt")
        if os.path.isfile(bench_txt):
            with open(bench_txt) as f:
                lines += ["", "## Benchmark", "", "```", f.read().rstrip(), "```"]
        loop_txt = os.path.join(self.out, LOOP_TXT)
        if os.path.isfile(loop_txt):
            with open(loop_txt) as f:
                lines += ["", "## The default training loop", "", f.read().rstrip()]
        bad = [o for o in self.outcomes if o.status in (FAIL, TIMEOUT)]
        if bad:
            lines += ["", "## What failed", ""]
            for o in bad:
                lines.append(f"- **{o.name}** ({o.status}): {o.reason}")
                for name in (o.details.get("failed_checks") or [])[:10]:
                    lines.append(f"  - {name}")
        lines += ["", f"Each stage's command and whole output: `{LOG}`; checks and measurements: `{SUMMARY_JSON}`.",
                  ""]
        return "\n".join(lines)

    def finish(self) -> int:
        self.write()
        shutil.rmtree(self.work, ignore_errors=True)
        overall, counts = self.overall()
        with open(os.path.join(self.out, SUMMARY_MD)) as f:
            print("\n" + f.read())
        print(f"wrote {', '.join(os.path.join(self.out, n) for n in self.files())}")
        return 1 if overall == FAIL else 0


def threads_env(workers: int) -> Dict[str, str]:
    """CPU threads per pytest worker: the cores shared out. With torch's default (every core) in each of 8
    workers, the tests' host-side work (building problems, the fp64 oracle, comparisons) ran 10 s a test on a
    16-core GPU machine, mostly threads waiting on each other; one thread does it in a fraction of a second."""
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, workers)))}


def sanitizer_command(sanitizer: str, tool: str) -> List[str]:
    """compute-sanitizer's command for ``tool``: the Python process only (no child is sanitized), connecting
    whenever it initializes CUDA (``--launch-timeout 0``: the stage's limit bounds the wait), the per-access
    tools restricted to ampfused's kernels (SANITIZED_KERNELS)."""
    cmd = [sanitizer, "--tool", tool, "--print-limit", "100", "--launch-timeout", "0",
           "--target-processes", "application-only"]
    if tool != "initcheck":
        for k in SANITIZED_KERNELS:
            cmd += ["--kernel-name", k]
    if tool == "memcheck":  # nothing here allocates from the device heap (device-side malloc): no heap tracking
        cmd += ["--check-device-heap", "no"]
    return cmd


def _failed(data: Optional[dict]) -> List[str]:
    if not data:
        return []
    return [f"{c['name']}: {c.get('error', '')}"[:600] for c in data.get("checks", []) if not c.get("ok")]


def _md_cell(text: str) -> str:
    text = (text or "").replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 600 else text[:600] + " [...]"


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _git_commit() -> str:
    from ..common.env import git_sha  # imported here: the driver itself starts before anything is built
    return git_sha()


# -------------------------------------------------------------------------------------------------- cli

def _names(value: str) -> List[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    known = set(STAGE_NAMES) | {g for s in STAGES for g in s.groups}
    bad = [n for n in names if n not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown stage(s) {bad}; stages: {', '.join(STAGE_NAMES)}; groups: "
                                         f"{', '.join(sorted({g for s in STAGES for g in s.groups}))}")
    return names


def _limit(value: str) -> Tuple[str, float]:
    name, _, secs = value.partition("=")
    if name not in STAGE_NAMES or not secs:
        raise argparse.ArgumentTypeError(f"--limit wants STAGE=SECONDS with a stage of {', '.join(STAGE_NAMES)}")
    return name, float(secs)


def parser() -> argparse.ArgumentParser:
    table = "\n".join(f"  {s.name:<20} {s.limit:>4.0f} s  {'GPU ' if s.gpu else 'host'}  {s.title}" for s in STAGES)
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu", description=__doc__.split("\n\n")[0],
        epilog=f"stages (default limits, sum {sum(s.limit for s in STAGES):.0f} s):\n{table}\n\ngroups: suite, "
               "sanitizer, probes\n\nexample (a GPU machine, from the checkout):\n  python3 -m bench.gpu "
               "\"$OUT\"\na dry run without a GPU:\n  python3 -m bench.gpu /tmp/gpu-check --skip build,suite",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", metavar="OUT_DIR", help="where the summary, the log and the benchmark files go")
    p.add_argument("--part", choices=sorted(PARTS), default=None,
                   help="run one part of the check, sized for one 10-minute command: " + "; ".join(
                       f"{k}: {v.title}" for k, v in PARTS.items()) + ". Merge the parts' folders with "
                       "python -m bench.gpu.merge OUT_DIR PART_DIR...")
    p.add_argument("--skip", type=_names, default=[], help="comma list of stages or groups to skip")
    p.add_argument("--only", type=_names, default=[], help="comma list of stages or groups to run (env always "
                                                           "runs unless skipped: the GPU stages need it)")
    p.add_argument("--limit", type=_limit, action="append", default=[], metavar="STAGE=SECONDS",
                   help="another time limit for one stage (repeatable)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole run; a stage gets at most what is left (default {DEFAULT_BUDGET:.0f}, "
                        "a part's own with --part)")
    p.add_argument("--no-rollover", action="store_true",
                   help="a stage gets only its own limit (default: also what earlier stages left unused, as long as "
                        "every later stage keeps its own)")
    p.add_argument("--no-gpu", action="store_true", help="report every GPU stage as skipped")
    p.add_argument("--archs", default=None, help="AMPFUSED_CUDA_ARCHS for the build (default: the device's, e.g. 90)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="MAX_JOBS for the build (default: cores)")
    p.add_argument("--workers", type=int, default=min(14, max(1, (os.cpu_count() or 1) - 2)),
                   help="pytest-xdist workers for the rest of the suite when xdist is installed (default: the cores "
                        "but two, at most 14; 1 runs without xdist)")
    p.add_argument("--gpu-workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="pytest-xdist workers for the GPU-marked tests, which share the device (default 8)")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS, help=f"benchmark workloads (default {DEFAULT_WORKLOADS})")
    p.add_argument("--bench-args", type=shlex.split, default=[],
                   help="more arguments for python -m bench, as one string (e.g. \"--reps 50\")")
    p.add_argument("--python", default=None, help="the interpreter every stage runs (default: this one)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    args.limit = dict(args.limit)
    if args.part:  # the part's stages, limits and budget; --only, --limit, --budget given too still win
        part = PARTS[args.part]
        args.only = args.only or list(part.only)
        args.limit = {**part.limits, **args.limit}
        args.budget = args.budget if args.budget is not None else part.budget
    if args.only and "env" not in args.only and "env" not in args.skip:
        args.only = ["env"] + args.only
    run = Run(args)
    print(f"ampfused GPU check: {len(STAGES)} stages, budget {args.budget:.0f} s, output in {run.out}", flush=True)
    try:
        for i, stage in enumerate(STAGES):
            run.run_stage(i, stage)
    except KeyboardInterrupt:
        print("interrupted: writing what was done", file=sys.stderr)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
