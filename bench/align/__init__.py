"""The alignment study, ``python -m bench.align``: does ampfused train to the same loss as torch's
mixed-precision recipe (run: the command; model: model, data, schedule; runs: the training runs; report: figures,
bars, tables, CSV, plot)."""
