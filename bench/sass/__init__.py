"""K2's machine code, read without a GPU: ``python -m bench.sass`` (``__main__``).
"""
