"""Build of ampfused: the Python package plus two torch-free native modules and one built against torch.

* ``ampfused._C``: the CPU backend (C++17, OpenMP). On x86-64 the kernels are compiled three times
  (baseline, AVX2, AVX-512) and the module picks one at run time, so a wheel built here runs anywhere.
* ``ampfused._C_cuda``: the CUDA backend, built when nvcc is found; cudart is linked statically, so the
  module imports on a machine without a GPU or driver and its calls then report why they cannot run.
* ``ampfused._host``: the fused optimizers' per-step pass over their parameters (addresses, version counters,
  gradients) in C++. It reads torch tensors, so it is built against the torch that is installed (build with
  ``pip install --no-build-isolation``, as for any torch extension) and loads only with that torch; without
  it the optimizers do the same work in Python.

The kernel modules need no torch headers: they take raw addresses, sizes, dtype codes and a stream handle.
Objects are compiled by ninja when it is present (parallel and incremental), else by a thread pool.

Build switches (environment, read once here):
  AMPFUSED_SKIP_NATIVE_BUILD=1   build neither module (pure-Python install; the reference backend runs)
  AMPFUSED_SKIP_CUDA_BUILD=1     do not build ampfused._C_cuda even when nvcc is found
  AMPFUSED_CPU_ISAS=default      build only the portable CPU kernels, not the AVX2 and AVX-512 ones (a quicker
                                 build with the same results: the kernels' bits do not depend on the ISA)
  AMPFUSED_CUDA_ARCHS="80;90"    GPU architectures (A100, H100); archs the found nvcc lacks are skipped
  AMPFUSED_NVCC_THREADS=N        nvcc --threads (archs compiled in parallel inside one nvcc)
  MAX_JOBS=N                     parallel compile jobs (default: from cores and free memory)
  CUDA_HOME                      CUDA toolkit root (default: found from nvcc)
"""
import concurrent.futures
import glob
import importlib.util
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

VERSION = "0.1.0"
ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")

SKIP_NATIVE = os.environ.get("AMPFUSED_SKIP_NATIVE_BUILD", "0") == "1"
SKIP_CUDA = os.environ.get("AMPFUSED_SKIP_CUDA_BUILD", "0") == "1"
CPU_ISAS = os.environ.get("AMPFUSED_CPU_ISAS", "all")
if CPU_ISAS not in ("all", "default"):
    raise SystemExit(f"AMPFUSED_CPU_ISAS must be 'all' or 'default', got {CPU_ISAS!r}")
CUDA_ARCHS = os.environ.get("AMPFUSED_CUDA_ARCHS", "80;90")
NVCC_THREADS = os.environ.get("AMPFUSED_NVCC_THREADS")
MAX_JOBS = os.environ.get("MAX_JOBS")
CUDA_HOME = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
IS_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _load_sources_module():
    spec = importlib.util.spec_from_file_location("_ampfused_sources", os.path.join(ROOT, "ampfused", "_sources.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sources_hash(kind: str) -> str:
    """Hash of the csrc/ folders module ``kind`` is built from (ampfused/_sources.py; the loader compares it to
    detect a stale build, so editing one module's sources leaves the others current)."""
    return _load_sources_module().sources_hash(CSRC, kind)


def find_nvcc():
    """(nvcc, cuda_root) or (None, None). The root holds include/ and lib64/libcudart_static.a."""
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return None, None
    roots = [CUDA_HOME] if CUDA_HOME else []
    roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    try:  # nvcc may be a wrapper script: ask it where its toolkit is
        out = subprocess.run([nvcc, "--dryrun", "--version"], capture_output=True, text=True).stderr
        roots += [os.path.normpath(m) for m in re.findall(r"^#\$ TOP=(\S+)", out, re.M)]
    except OSError:
        pass
    roots.append("/usr/local/cuda")
    for r in roots:
        if r and os.path.exists(os.path.join(r, "include", "cuda_runtime.h")):
            return nvcc, r
    return nvcc, None


def nvcc_version(nvcc) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def gencode_flags(nvcc):
    """-gencode for each requested arch the found nvcc supports, plus PTX of the newest for later GPUs."""
    try:
        listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout.split()
    except OSError:
        listed = []
    archs = []
    for a in re.split(r"[;,\s]+", CUDA_ARCHS.strip()):
        a = a.replace(".", "").replace("sm_", "")
        if not a:
            continue
        base = re.match(r"\d+", a).group(0)
        if listed and f"compute_{base}" not in listed:
            print(f"ampfused: skipping CUDA arch {a}: not supported by {nvcc}", file=sys.stderr)
            continue
        archs.append(a)
    if not archs:
        raise RuntimeError(f"none of AMPFUSED_CUDA_ARCHS={CUDA_ARCHS!r} is supported by {nvcc}")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    ptx = re.match(r"\d+", archs[-1]).group(0)  # portable PTX (no 'a' features) for later GPUs
    flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    return archs, flags


def default_jobs() -> int:
    if MAX_JOBS:
        return max(1, int(MAX_JOBS))
    cores = os.cpu_count() or 1
    try:  # an nvcc job can take ~2 GiB
        mem_gib = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
        return max(1, min(cores, int(mem_gib // 2)))
    except (ValueError, OSError, AttributeError):
        return cores


class NativeExtension(Extension):
    """An extension compiled by NativeBuild: per-source extra flags, .cu files through nvcc."""

    def __init__(self, name, sources, cxx_flags=(), per_source=None, nvcc=None, nvcc_flags=(),
                 link_flags=(), defines=(), split=None):
        super().__init__(name, sources=sources)
        # source basename -> {part: extra flags}: compiled once per part, each object one part of its drivers
        self.split = split or {}
        self.cxx_flags = list(cxx_flags)
        self.per_source = per_source or {}
        self.nvcc = nvcc
        self.nvcc_flags = list(nvcc_flags)
        self.link_flags = list(link_flags)
        self.defines = list(defines)


class NativeBuild(build_ext):
    """Compiles every object of every extension in one ninja run (or a thread pool), then links each."""

    def build_extensions(self):
        cxx = os.environ.get("CXX", "c++")
        py_inc = sysconfig.get_paths()["include"]
        import pybind11

        base = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-DNDEBUG", f"-I{py_inc}",
                f"-I{pybind11.get_include()}", f"-I{os.path.join(CSRC, 'include')}"]
        jobs, links = [], []
        for ext in self.extensions:
            objs = []
            tmp = os.path.join(os.path.abspath(self.build_temp), ext.name.replace(".", "_"))
            os.makedirs(tmp, exist_ok=True)
            for src in ext.sources:
                src = os.path.abspath(src)
                stem = os.path.join(tmp, os.path.relpath(src, ROOT).replace(os.sep, "_"))
                extra = ext.per_source.get(os.path.basename(src), [])
                if src.endswith(".cu"):
                    cmd = [ext.nvcc] + ext.nvcc_flags + ext.defines + extra
                else:
                    cmd = [cxx] + base + ext.cxx_flags + ext.defines + extra
                parts = ext.split.get(os.path.basename(src)) or {None: []}
                for part, flags in parts.items():
                    obj = stem + ("" if part is None else f".{part}") + ".o"
                    jobs.append((cmd + flags, src, obj, src.endswith(".cu")))
                    objs.append(obj)
            links.append((ext, objs))
        # ampfused._host is optional (the optimizers have a Python path): a failure to build it against the
        # installed torch is reported and the install goes on without it
        host_objs = {obj for ext, objs in links if ext.name == "ampfused._host" for obj in objs}
        # compiled alongside the kernel modules (its own ninja file), not after them: the build's time is then
        # its slowest object, not that plus the host module's
        with concurrent.futures.ThreadPoolExecutor(1) as side:
            host_build = side.submit(self._compile, [j for j in jobs if j[2] in host_objs], "host")
            try:
                self._compile([j for j in jobs if j[2] not in host_objs])
            except subprocess.CalledProcessError as e:
                cuda = any(j[3] for j in jobs)
                hint = " (AMPFUSED_SKIP_CUDA_BUILD=1 builds without the CUDA backend)" if cuda else ""
                raise RuntimeError(f"compiling ampfused's native modules failed: {e}{hint}") from None
            host_error = host_build.exception()
        built = []
        for ext, objs in links:
            out = self.get_ext_fullpath(ext.name)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            try:
                if ext.name == "ampfused._host" and host_error is not None:
                    raise host_error
                self._run([cxx, "-shared", "-o", out] + objs + ext.link_flags)
            except subprocess.CalledProcessError as e:
                if ext.name != "ampfused._host":
                    raise RuntimeError(f"linking {ext.name} failed: {e}") from None
                SKIPPED["host"] = (f"building it against the installed torch failed ({e}); the fused optimizers use "
                                   "their Python path")
                continue
            built.append(ext.name)
        self.extensions = [ext for ext in self.extensions if ext.name in built]
        self._summary(built)

    @staticmethod
    def _summary(built) -> None:
        """One line per native module: built, or skipped and why (pip shows it with -v; `python -m ampfused.info`
        tells the same after the install)."""
        lines = []
        for name, why in [("ampfused._C", SKIPPED.get("cpu")), ("ampfused._C_cuda", SKIPPED.get("cuda")),
                          ("ampfused._host", SKIPPED.get("host"))]:
            lines.append(f"ampfused: {name}: " + ("built" if name in built else f"skipped ({why or 'not requested'})"))
        print("\n".join(lines), file=sys.stderr, flush=True)

    def copy_file(self, infile, outfile, *args, **kwargs):
        """Replace (new inode), never overwrite in place: a running process may have the old module mapped."""
        if os.path.isdir(outfile):
            outfile = os.path.join(outfile, os.path.basename(infile))
        tmp = f"{outfile}.tmp{os.getpid()}"
        shutil.copy2(infile, tmp)
        os.replace(tmp, outfile)
        return outfile, 1

    def _run(self, cmd):
        print(" ".join(shlex.quote(c) for c in cmd))
        subprocess.check_call(cmd)

    def _compile(self, jobs, name="main"):
        if not jobs:
            return
        n = default_jobs()
        ninja = shutil.which("ninja")
        if ninja:
            root = os.path.join(os.path.abspath(self.build_temp), "ninja", name)  # one per concurrent ninja
            os.makedirs(root, exist_ok=True)
            path = os.path.join(root, "build.ninja")
            lines = ["ninja_required_version = 1.3", f"builddir = {root}",
                     "rule cxx", "  command = $cmd -MMD -MF $out.d -c $in -o $out", "  depfile = $out.d",
                     "  deps = gcc", "  description = CXX $in",
                     "rule cuda", "  command = $cmd -MD -MF $out.d -c $in -o $out", "  depfile = $out.d",
                     "  deps = gcc", "  description = NVCC $in"]
            esc = lambda p: p.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")  # noqa: E731
            for cmd, src, obj, is_cu in jobs:
                lines.append(f"build {esc(obj)}: {'cuda' if is_cu else 'cxx'} {esc(src)}")
                lines.append("  cmd = " + " ".join(shlex.quote(c) for c in cmd).replace("$", "$$"))
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
            self._run([ninja, "-C", os.path.dirname(path), "-f", path, "-j", str(n)])
            return
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            for f in [pool.submit(self._run, cmd + ["-c", src, "-o", obj]) for cmd, src, obj, _ in jobs]:
                f.result()


def accepts_flag(cxx, flag) -> bool:
    probe = subprocess.run([cxx, flag, "-x", "c++", "-fsyntax-only", "-"], input="int main(){}",
                           capture_output=True, text=True)
    return probe.returncode == 0


SKIPPED = {}  # module kind -> why it is not built


def host_extension(cxx, identity):
    """``ampfused._host``, built against the torch importable now (None, with the reason kept, without one)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        SKIPPED["host"] = (f"torch is not importable at build time ({e}); install with --no-build-isolation to build "
                           "it against the installed torch")
        return None
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    std = "-std=c++20" if accepts_flag(cxx, "-std=c++20") else "-std=c++17"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    flags = [std, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H", "-w"] + \
        [f"-I{p}" for p in cpp_extension.include_paths()]
    link = [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    if sys.platform == "darwin":
        link += ["-undefined", "dynamic_lookup"]
    return NativeExtension("ampfused._host", ["csrc/host/host.cpp"], cxx_flags=flags, link_flags=link,
                           per_source={"host.cpp": identity + [f'-DAMPFUSED_TORCH_VERSION="{torch.__version__}"']})


def native_extensions():
    if SKIP_NATIVE:
        SKIPPED.update(cpu="AMPFUSED_SKIP_NATIVE_BUILD=1", cuda="AMPFUSED_SKIP_NATIVE_BUILD=1")
        return []
    cxx = os.environ.get("CXX", "c++")
    # only the module files carry the build's identity, so editing one kernel recompiles only it
    identity = [f'-DAMPFUSED_VERSION="{VERSION}"', f'-DAMPFUSED_SOURCES_HASH="{sources_hash("cpu")}"']
    host_identity = [f'-DAMPFUSED_VERSION="{VERSION}"', f'-DAMPFUSED_SOURCES_HASH="{sources_hash("host")}"']
    cuda_base = [f'-DAMPFUSED_VERSION="{VERSION}"', f'-DAMPFUSED_SOURCES_HASH="{sources_hash("cuda")}"']
    # No contraction (fp32 results follow the written expression on every ISA); no errno, so sqrt
    # vectorises; results are unchanged by either.
    flags = ["-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fno-unswitch-loops"]
    omp = ["-fopenmp"] if accepts_flag(cxx, "-fopenmp") else []
    cpu_sources = ["csrc/cpu/module.cpp", "csrc/cpu/kernels_default.cpp"]
    per_source, isa_defines = {"module.cpp": identity}, []
    if IS_X86 and CPU_ISAS == "all":
        cpu_sources += ["csrc/cpu/kernels_avx2.cpp", "csrc/cpu/kernels_avx512.cpp"]
        per_source = {"module.cpp": identity, "kernels_avx2.cpp": ["-mavx2"],
                      "kernels_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                                             "-mprefer-vector-width=512"]}
        isa_defines = ["-DAMPFUSED_HAVE_AVX2", "-DAMPFUSED_HAVE_AVX512"]
    link = omp + (["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else [])
    # each instruction set's drivers in one object for K1 and one per optimizer (csrc/cpu/steps/*.h, each named by
    # AMPFUSED_CPU_STEP_FILE in csrc/cpu/kernels_impl.h), compiled in parallel: a new optimizer is a new file there
    steps = {"k1": []}
    for path in sorted(glob.glob(os.path.join(CSRC, "cpu", "steps", "*.h"))):
        name = os.path.splitext(os.path.basename(path))[0]
        steps[name] = [f'-DAMPFUSED_CPU_STEP_FILE="steps/{name}.h"']
    split = {os.path.basename(src): steps for src in cpu_sources if "kernels_" in src}
    exts = [NativeExtension("ampfused._C", cpu_sources, cxx_flags=flags + omp, per_source=per_source,
                            link_flags=link, defines=isa_defines, split=split)]
    host = host_extension(cxx, host_identity)
    if host is not None:
        exts.append(host)
    nvcc, cuda_root = (None, None) if SKIP_CUDA else find_nvcc()
    if nvcc and cuda_root:
        archs, gencode = gencode_flags(nvcc)
        threads = NVCC_THREADS or str(max(1, min(len(archs), (os.cpu_count() or 1) // 2)))
        cuda_identity = cuda_base + [f'-DAMPFUSED_CUDA_ARCHS="{";".join(archs)}"',
                                    f'-DAMPFUSED_NVCC_VERSION="{nvcc_version(nvcc)}"']
        nvcc_flags = ["-O3", "-std=c++17", "--fmad=false", "--threads", threads, "-Xcompiler", "-fPIC",
                      "-Xcompiler", "-fvisibility=hidden", "-DNDEBUG", f"-I{os.path.join(CSRC, 'include')}",
                      f"-I{os.path.join(cuda_root, 'include')}"] + gencode
        libdir = next((os.path.join(cuda_root, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")
                       if os.path.exists(os.path.join(cuda_root, d, "libcudart_static.a"))), None)
        if libdir is None:
            raise RuntimeError(f"nvcc found at {nvcc} but no libcudart_static.a under {cuda_root}; "
                               "set CUDA_HOME, or AMPFUSED_SKIP_CUDA_BUILD=1")
        # static cudart, kept private to this module (no symbol clash with torch's libcudart)
        cuda_link = [f"-L{libdir}", "-lcudart_static", "-ldl", "-lrt", "-lpthread",
                     "-Wl,--exclude-libs,ALL", "-Wl,-Bsymbolic"]
        # every .cu file: each optimizer's kernels and step entry are a file (or a few) of their own
        cuda_sources = ["csrc/cuda/module.cpp"] + sorted(
            os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
        exts.append(NativeExtension("ampfused._C_cuda", cuda_sources, nvcc=nvcc, nvcc_flags=nvcc_flags,
                                    cxx_flags=flags, link_flags=cuda_link,
                                    per_source={"module.cpp": cuda_identity}))
    elif SKIP_CUDA:
        SKIPPED["cuda"] = "AMPFUSED_SKIP_CUDA_BUILD=1"
    else:
        SKIPPED["cuda"] = ("nvcc not found: set CUDA_HOME to build the CUDA backend" if not nvcc else
                           f"no CUDA toolkit headers next to {nvcc}: set CUDA_HOME")
        print(f"ampfused: {SKIPPED['cuda']}; building the CPU backend only", file=sys.stderr)
    return exts


packages = find_packages(include=["ampfused", "ampfused.*"])
package_dir = {"ampfused.triton_kernels": "triton_kernels"}
packages.append("ampfused.triton_kernels")

setup(
    name="ampfused",
    version=VERSION,
    description="Fused mixed-precision optimizer step for PyTorch: unscale, inf check, norm, clip, update",
    python_requires=">=3.9",
    packages=packages,
    package_dir=package_dir,
    ext_modules=native_extensions(),
    cmdclass={"build_ext": NativeBuild},
    install_requires=["torch>=2.4", "numpy", "triton; platform_system == 'Linux'"],
    # the test suite runs the benchmark end to end (table, CSV and plot), so it needs the bench extras too;
    # "integrations": the framework versions tests/integrations runs against, each of which accepts any
    # torch >= 2.4 (torch 2.13 included), so installing them never makes pip replace the installed torch
    extras_require={"test": ["pytest", "pytest-benchmark", "hypothesis", "matplotlib", "tqdm", "safetensors",
                             # the suite in any order and in parallel: pytest -p random_order --random-order,
                             # pytest -n 2 (CI's: the README's test command)
                             "pytest-random-order", "pytest-xdist",
                             # the source-archive test builds the native modules without build isolation
                             "pybind11>=2.10",
                             # torch.testing._internal (PyTorch's optimizer test material, tests/torch_suite)
                             "expecttest",
                             # cuobjdump -sass (and the nvdisasm it runs): python -m bench.sass reads the CUDA
                             # kernels' machine code without a GPU (tests/test_bench_sass.py)
                             "nvidia-cuda-cuobjdump; platform_system == 'Linux'",
                             "nvidia-cuda-nvdisasm; platform_system == 'Linux'"],
                    "bench": ["matplotlib", "tqdm"],
                    "integrations": ["accelerate==1.15.0", "transformers==5.23.0", "lightning==2.6.6",
                                     "safetensors==0.8.0",
                                     # needs torch >= 2.11 (through torch_checkpointing); brings its own pins
                                     # (spmd_types, datasets < 4.8, which holds huggingface_hub < 2)
                                     "torchtitan==0.3.0"],
                    # other libraries' optimizers for `python -m bench --peers`, `python -m bench.align --modes`
                    # and the orthogonalised-momentum benchmark (heavyball); each accepts the installed torch
                    # (torchao and torch-optimi declare no torch pin or torch>=2.2, flashoptim torch>=2.6 and
                    # triton, bitsandbytes torch>=2.3; its 8-bit optimizers run on the CPU too), and none is needed
                    # by the package or its tests
                    "peers": ["torchao==0.18.0", "torch-optimi==0.3.3", "flashoptim==0.1.4", "bitsandbytes==0.50.2",
                              "heavyball==3.2.1"]},
)
