import os
import sys

# the helpers shared with the main suite (oracle.py, recipe.py) live one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """The models here are tiny: one thread runs them faster than two fighting over small kernels, and keeps
    the time of these suites steady on a loaded machine (ampfused's results do not depend on the count)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
