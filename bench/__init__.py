"""``python -m bench``: ampfused's optimizer step against torch's mixed-precision recipes.

Every variant is checked against ``ampfused.ops.reference`` before it is timed. Results go to
``bench/results/<device>.csv`` (one row per measurement), a table on stdout and a log-log plot; see
``python -m bench --help`` and the modules: workloads, bytes (the byte model), variants, ampfused_variant,
check, measure, report, plot, compare, cli. ``python -m bench --distributed`` times ZeRO-1 against DDP and
torch's recipe on several processes instead (distributed).
"""
