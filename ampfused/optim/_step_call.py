"""The call of a fused optimizer's ``step``: torch.optim's step hooks, its profiler range, no autograd.

``torch.optim.Optimizer`` wraps every subclass's ``step`` (``profile_hook_step``) in a profiler range named
``Optimizer.step#<class>.step`` and runs the step pre/post hooks around it. Entering that range costs several
microseconds even with no profiler running (it builds a record-function object through the dispatcher), as
much as the whole host part of a warm step over 200 tensors. :func:`hooked_step` keeps torch's wrapper, and
``torch.no_grad``, whenever a profiler (or emit_nvtx) is on or the step is being compiled; otherwise it runs the
same hooks in the same order around the step with autograd off, without the range nobody records.
"""
from __future__ import annotations

import functools
from itertools import chain

import torch
from torch.optim import optimizer as _torch_optimizer

_profiler_enabled = torch._C._autograd._profiler_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled


def hooked_step(func):
    """``func`` (a step without a no_grad decorator) as torch.optim would call it; marked ``hooked`` so that
    ``Optimizer.__init__`` does not wrap it again."""
    wrapped = torch.optim.Optimizer.profile_hook_step(torch.no_grad()(func))

    @functools.wraps(func)
    def step(*args, **kwargs):
        self = args[0]
        if torch.compiler.is_compiling() or _profiler_enabled():
            return wrapped(*args, **kwargs)
        for pre_hook in chain(_torch_optimizer._global_optimizer_pre_hooks.values(),
                              self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, args, kwargs)
            if result is not None:
                if isinstance(result, tuple) and len(result) == 2:
                    args, kwargs = result
                else:
                    raise RuntimeError(f"{func} must return None or a tuple of (new_args, new_kwargs), but got "
                                       f"{result}.")
        enabled = _is_grad_enabled()
        _set_grad_enabled(False)
        try:
            out = func(*args, **kwargs)
        finally:
            _set_grad_enabled(enabled)
        self._optimizer_step_code()
        for post_hook in chain(self._optimizer_step_post_hooks.values(),
                               _torch_optimizer._global_optimizer_post_hooks.values()):
            post_hook(self, args, kwargs)
        return out

    step.hooked = True
    return step
