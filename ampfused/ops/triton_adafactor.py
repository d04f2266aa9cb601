"""``adafactor_step_`` on the Triton backend (a method of ``TritonBackend``): the Adafactor table
(``native_adafactor.table``) uploaded once per call site and reused while the tensors stay the same, one launch."""
from __future__ import annotations

from . import native_args as _A


def adafactor_step_(self, params, grads, master, factors, steps, partials, inv_scale, lr, out_stats, beta2_decay,
                     eps1, eps2, d, weight_decay, max_norm, maximize=False, seed=None) -> None:
    """Adafactor: one launch, one program per parameter (``triton_kernels/adafactor.py``); math in
    :func:`ampfused.ops.reference_adafactor.adafactor_step_`."""
    from .. import _work
    from . import native_adafactor
    from .triton import _capturing, _kernels
    from .reference_adafactor import EPS1_DEFAULT
    params, grads = list(params), list(grads)
    native_adafactor.check(self.name, params, grads, master, factors, steps, partials, inv_scale, lr, out_stats, seed)
    rows = native_adafactor.table(params, grads)
    device = steps.device

    def build():
        host, view = _work.staging(len(rows), device)
        view[:len(rows)] = rows
        return _work.upload(host, device), host

    table, _ = self.step_tables.get((device, steps.data_ptr(), "adafactor"), rows, build, _capturing(device),
                                    "the parameters and gradients of an Adafactor step")
    pdtype, gdtype = self._step_dtypes(params, grads)
    fmt = _kernels("_compact").launch_format(pdtype, master, None, seed)
    _kernels("adafactor").adafactor_step_(
        table, len(params), pdtype, gdtype, fmt, master, factors, steps, _A.partials_arg(partials), inv_scale,
        lr, out_stats, beta2_decay, EPS1_DEFAULT if eps1 is None else eps1, eps2, d, weight_decay, max_norm,
        maximize, seed)

