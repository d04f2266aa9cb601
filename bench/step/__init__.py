"""The step benchmark, ``python -m bench``: ampfused's optimizer step against torch's mixed-precision recipes.

Every variant is checked against ``ampfused.ops.reference`` before it is timed. Results go to
``<out>/<device>.csv`` (one row per measurement), a table on stdout and a log-log plot; see
``python -m bench --help`` and the modules: workloads, variants, ampfused_variant, check, runner, report, plot
(``python -m bench.step.plot``), compare (``python -m bench.step.compare``), cli; host_time
(``python -m bench.step.host_time``) times the host side of one step. The byte model and the measuring code are
in ``bench.common``.
"""
