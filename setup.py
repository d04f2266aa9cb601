"""Build of ampfused. Native extensions are added by ``_native_extensions()``; the pure-Python package
installs on a machine with no GPU and no CUDA toolkit."""
from setuptools import find_packages, setup

packages = find_packages(include=["ampfused", "ampfused.*"])
package_dir = {"ampfused.triton_kernels": "triton_kernels"}
packages.append("ampfused.triton_kernels")

setup(
    name="ampfused",
    version="0.1.0",
    description="Fused mixed-precision optimizer step for PyTorch: unscale, inf check, norm, clip, update",
    python_requires=">=3.9",
    packages=packages,
    package_dir=package_dir,
    install_requires=["torch>=2.4", "numpy", "triton; platform_system == 'Linux'"],
    extras_require={"test": ["pytest", "pytest-benchmark", "hypothesis"], "bench": ["matplotlib", "tqdm"]},
)
