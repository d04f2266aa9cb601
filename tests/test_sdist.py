"""The source archive installs: ``setup.py sdist`` ships every source and header the native build compiles, and
the archive installed into a fresh virtual environment imports and runs the native CPU backend."""
import os
import site
import subprocess
import sys
import tarfile
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def _sources():
    out = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "csrc")):
        for f in files:
            if f.endswith((".h", ".cuh", ".cpp", ".cu")):
                out.add(os.path.relpath(os.path.join(dirpath, f), ROOT))
    return out


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    out = tmp_path_factory.mktemp("sdist")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(out)], cwd=ROOT, check=True,
                   capture_output=True, env=dict(os.environ, AMPFUSED_SKIP_NATIVE_BUILD="1"))
    (archive,) = out.glob("ampfused-*.tar.gz")
    return archive


def test_the_archive_ships_every_native_source_and_header(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = sorted(_sources() - names)
    assert not missing, f"the sdist lacks {missing}"
    assert {"setup.py", "pyproject.toml", "triton_kernels/adam.py", "ampfused/__init__.py"} <= names


def _fresh_env(path) -> str:
    """A new virtual environment whose imports also find this one's packages (torch, pybind11, ninja, pip),
    so nothing is downloaded; this environment's own ampfused is not among them."""
    venv.EnvBuilder(with_pip=False).create(path)
    python = str(path / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    parents = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    with open(os.path.join(purelib, "parent_env.pth"), "w") as f:
        f.write("\n".join(parents) + "\n")
    return python


def test_the_archive_installs_and_runs_the_cpu_backend(sdist, tmp_path):
    python = _fresh_env(tmp_path / "venv")
    # the portable CPU kernels only: the AVX2 / AVX-512 files are the same header built with other flags (shipped:
    # the test above), and building them from the archive too would double this test's time
    env = dict(os.environ, AMPFUSED_SKIP_CUDA_BUILD="1", AMPFUSED_CPU_ISAS="default", PIP_NO_INDEX="1")
    env.pop("PYTHONPATH", None)
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", str(sdist)],
                             env=env, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    check = (
        "import ampfused, torch\n"
        "from ampfused import ops, _native\n"
        f"assert ampfused.__file__.startswith({str(tmp_path / 'venv')!r}), ampfused.__file__\n"
        "assert _native.unavailable_reason('cpu') is None, _native.unavailable_reason('cpu')\n"
        "assert ops.available_backends('cpu')[0] == 'cpu'\n"
        "p = torch.nn.Parameter(torch.randn(100, dtype=torch.bfloat16)); p.grad = torch.ones_like(p)\n"
        "opt = ampfused.FusedAdamW([p], lr=0.1, backend='cpu'); before = p.detach().clone(); opt.step()\n"
        "assert not torch.equal(before, p.detach())\n"
        "print('ok', ampfused.__file__)\n"
    )
    run = subprocess.run([python, "-c", check], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
