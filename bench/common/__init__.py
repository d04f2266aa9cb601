"""What the benchmark jobs share: timing, launches and memory (measure), the byte model of a step (bytes), where a
result was measured (env), CSV rows (csv_rows)."""
