"""``python -m bench``: the step benchmark (``bench.step``); ``python -m bench --distributed`` runs
``bench.distributed`` instead."""
import sys

from .step.cli import main

sys.exit(main())
