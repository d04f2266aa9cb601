import os

import torch  # importing torch does not import triton

# Without a CUDA device the Triton kernels run on CPU tensors under the interpreter, which must be chosen
# before triton is imported anywhere. With one they run compiled, on CUDA tensors; TRITON_INTERPRET=1 set by
# hand still forces the interpreter, and AMPFUSED_TEST_NO_INTERPRET=1 keeps it off.
if not os.environ.get("AMPFUSED_TEST_NO_INTERPRET") and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
