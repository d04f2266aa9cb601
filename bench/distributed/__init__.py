"""The distributed benchmark, ``python -m bench.distributed`` (or ``python -m bench --distributed``): ZeRO-1
(``ampfused.ShardedFusedAdamW``) against DDP and torch's recipe on several processes (run: the driver and its
ranks; loops: the two training steps)."""
