"""GPU validation, ``python -m bench.gpu OUT_DIR``: build, test suite, sanitizers and probes on a GPU machine in
one command (check, tools); each workload also runs alone as ``python -m bench.gpu.probe NAME`` (probe,
probe_common, probe_sanitize, probe_big)."""
