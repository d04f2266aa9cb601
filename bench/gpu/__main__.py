"""``python -m bench.gpu OUT_DIR``: see :mod:`bench.gpu.check`."""
import sys

from .check import main

sys.exit(main())
