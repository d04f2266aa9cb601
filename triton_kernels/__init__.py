"""Triton kernels of ampfused, installed as ``ampfused.triton_kernels`` (never as a top-level
``triton_kernels``, the name of a package published from the triton repository).

One op per module, the ``@triton.jit`` kernels (prefixed ``_``) followed by their launcher: ``norm_check`` (K1 and
the in-place ``unscale_``), ``update_scale``, and one module per step op (K2), named by its record
(``ops.specs``: ``OpSpec.kernel``) and its launcher by the op (the arguments ``ops.triton``'s ``step`` passes);
``_common``
holds the shared prologue, step advance, conversions, the tensor tables and chunk lists the kernels walk, and
launch geometry; ``_compact`` the compact-state codecs (master remainders, stochastic rounding, bf16 moments)
and ``_q8`` those of 8-bit moments, both specified in ``ops.state_precision``. ``ops.triton``
calls the launchers; modules are imported on first use, and importing them touches no GPU.
"""
