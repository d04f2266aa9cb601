"""``python -m bench.align``: see :mod:`bench.align.run`."""
import sys

from .run import main

sys.exit(main())
