"""The torch recipe a fused optimizer replaces, on a model's own parameters, and its fp64 twin.

``TorchRecipe(params, torch.optim.AdamW, hyper)``: fp32 master copies of the fp16/bf16 parameters (the fp32
ones are their own masters, as ``master_weights=None`` promises), the torch optimizer on the masters,
``clip_grad_norm_`` over the masters that have a gradient, and the rounded masters copied back into the
parameters. ``master_dtype=torch.float64`` gives the twin whose error bounds the tolerance (tests/oracle.py).
Gradients are handed in explicitly, so both sides see the very same values.
"""
import torch

LOW = (torch.bfloat16, torch.float16)


class TorchRecipe:
    def __init__(self, params, opt_cls, hyper, *, master_dtype=torch.float32, max_norm=None, copy_params=True):
        src = list(params)
        self.params = [p.detach().clone() for p in src] if copy_params else src
        self.masters = [self._master(p, master_dtype) for p in self.params]
        self.opt = opt_cls(self.masters, **hyper)
        self.max_norm = max_norm
        self.master_dtype = master_dtype

    @staticmethod
    def _master(p, master_dtype):
        if p.dtype in LOW or master_dtype != p.dtype:
            return p.detach().to(master_dtype).clone().requires_grad_()
        return p.detach().clone().requires_grad_()

    def reset_master(self, i, value):
        """The master of parameter ``i`` rebuilt from new parameter values (moments and step kept)."""
        with torch.no_grad():
            self.masters[i].copy_(value.to(self.master_dtype))
            self.params[i].copy_(value)

    def step(self, grads):
        """One step with these gradients (``None``: the parameter has none this step); returns the norm."""
        for m, g in zip(self.masters, grads):
            m.grad = None if g is None else g.detach().to(self.master_dtype).clone()
        with_grad = [m for m in self.masters if m.grad is not None]
        norm = None
        if self.max_norm is not None and with_grad:
            norm = torch.nn.utils.clip_grad_norm_(with_grad, self.max_norm, foreach=False)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m.detach())
        return norm


def masters_of(opt, params):
    """The fused optimizer's master (or the fp32 parameter itself) of each parameter."""
    return [opt.state[p]["master_param"] if "master_param" in opt.state[p] else p.detach() for p in params]
