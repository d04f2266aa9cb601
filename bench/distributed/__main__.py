"""``python -m bench.distributed``: ``python -m bench --distributed`` with the same options."""
import sys

from ..step.cli import main

sys.exit(main(["--distributed", *sys.argv[1:]], prog="python -m bench.distributed"))
