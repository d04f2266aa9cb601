"""ampfused's benchmarks and checks, one subpackage per job.

- ``bench.step`` (``python -m bench``): ampfused's optimizer step against torch's mixed-precision recipes, every
  variant checked against ``ampfused.ops.reference`` before it is timed; ``python -m bench.step.host_time`` times
  the host side of one fused step.
- ``bench.distributed`` (``python -m bench.distributed``, or ``python -m bench --distributed``): ZeRO-1 against
  DDP and torch's recipe on several processes.
- ``bench.gpu`` (``python -m bench.gpu OUT_DIR``): validate ampfused on a GPU machine in one command; its
  workloads run alone as ``python -m bench.gpu.probe NAME``.
- ``bench.align`` (``python -m bench.align``): does ampfused train to the same loss as torch's recipe.
- ``bench.common``: what the jobs share (timing and memory measurement, the byte model, environment, CSV rows).

Results committed with the project live in ``bench/results/``.
"""
