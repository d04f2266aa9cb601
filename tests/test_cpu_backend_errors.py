"""The CPU backend's boundary: bad input to its ops is refused in Python, naming the tensor and the rule,
before any kernel runs and before anything changes; and the ops as registered with torch.library."""
import os

import pytest
import torch

from ampfused import ops
from ampfused.ops import reference as R
from oracle import assert_bitwise

if os.environ.get("AMPFUSED_SKIP_NATIVE_BUILD") == "1":
    pytest.skip("native modules not built (AMPFUSED_SKIP_NATIVE_BUILD=1)", allow_module_level=True)

BF16 = torch.bfloat16


def snapshot(*ts):
    return [t.clone() for t in ts if t is not None]


# ---- bad input is rejected in Python, before any kernel runs ----------------------------------------------

def step_tensors(device, n=64, gdt=BF16):
    """Arguments of a valid two-parameter AdamW step (n elements, then 8x8), by name."""
    total = R.state_layout([n, 64])[1]
    return dict(params=[torch.zeros(n, dtype=BF16, device=device), torch.zeros(8, 8, dtype=BF16, device=device)],
                grads=[torch.ones(n, dtype=gdt, device=device), torch.ones(8, 8, dtype=gdt, device=device)],
                master=torch.zeros(total, device=device), exp_avg=torch.zeros(total, device=device),
                exp_avg_sq=torch.zeros(total, device=device), steps=torch.zeros(2, device=device),
                partials=torch.tensor([[1.0], [0.0]], device=device), inv_scale=torch.tensor(1.0, device=device),
                lr=torch.tensor(0.1, device=device), out_stats=torch.zeros(2, device=device))


def misaligned(t):
    buf = torch.zeros(t.numel() + 8, dtype=t.dtype, device=t.device)
    return buf[1:t.numel() + 1]


def _set(key, i, f):
    def change(t, d):
        t[key] = list(t[key])
        t[key][i] = f(t[key][i], d)
    return change


def _put(key, f):
    def change(t, d):
        t[key] = f(t[key], d)
    return change


BAD_INPUTS = {
    "grad wrong dtype": (_set("grads", 0, lambda g, d: torch.ones(64, dtype=torch.int32, device=d)), TypeError,
                         r"grads\[0\] must have dtype"),
    "grads fp64": (_put("grads", lambda g, d: [x.double() for x in g]), RuntimeError,
                   r"dtypes \['torch.float64'\] not supported"),
    "grads of two dtypes": (_set("grads", 1, lambda g, d: g.float()), TypeError, r"grads\[1\] has dtype"),
    "params of two dtypes": (_set("params", 1, lambda p, d: p.float()), TypeError, r"params\[1\] has dtype"),
    "param not dense": (_set("params", 0, lambda p, d: torch.zeros(128, dtype=BF16, device=d)[::2]), ValueError,
                        r"params\[0\] .* is not dense"),
    "grad of another layout": (_set("grads", 1, lambda g, d: g.t().contiguous().t()), ValueError,
                               r"grads\[1\] .* must have the shape and memory layout of params\[1\]"),
    "grad of another size": (_set("grads", 0, lambda g, d: g[:63]), ValueError,
                             r"grads\[0\] .* must have the shape and memory layout"),
    "param on another device": (_set("params", 1, lambda p, d: torch.zeros(8, 8, dtype=BF16, device="meta")),
                                ValueError, r"params\[1\] must be on"),
    "grads too short": (_put("grads", lambda g, d: g[:1]), ValueError, "grads must have one entry per parameter"),
    "exp_avg wrong size": (_put("exp_avg", lambda t, d: t[:-1]), ValueError, "exp_avg must have 128 elements"),
    "exp_avg_sq wrong dtype": (_put("exp_avg_sq", lambda t, d: t.to(BF16)), TypeError, "exp_avg_sq must have dtype"),
    "master misaligned": (_put("master", lambda t, d: misaligned(t)), ValueError, "master must start at a 16-byte"),
    "master 2-d": (_put("master", lambda t, d: torch.zeros(1, t.numel(), device=d)), ValueError,
                   "master must be a 1-D"),
    "partials shape": (_put("partials", lambda t, d: torch.zeros(3, device=d)), ValueError, "partials must have shape"),
    "lr on meta": (_put("lr", lambda t, d: torch.tensor(0.1, device="meta")), ValueError, "lr must be on"),
    "steps int": (_put("steps", lambda t, d: torch.zeros(2, dtype=torch.int64, device=d)), TypeError,
                  "steps must have dtype"),
    "steps too short": (_put("steps", lambda t, d: t[:1]), ValueError, r"steps must be a contiguous 1-D tensor with one step count per parameter \(2\)"),
    "bf16 params without master": (_put("master", lambda t, d: None), ValueError, "master"),
    "state aliases master": (lambda t, d: t.update(exp_avg=t["master"]), ValueError,
                             "master and exp_avg must not overlap"),
}


def check_bad_inputs(device, backend):
    for case, (change, exc, msg) in BAD_INPUTS.items():
        t = step_tensors(device)
        change(t, device)
        live = [x for v in t.values() for x in (v if isinstance(v, list) else [v])
                if x is not None and x.device.type != "meta"]
        before = snapshot(*live)
        with pytest.raises(exc, match=msg):
            ops.adam_step_(t["params"], t["grads"], t["master"], t["exp_avg"], t["exp_avg_sq"], t["steps"],
                           t["partials"], t["inv_scale"], t["lr"], t["out_stats"], backend=backend)
        for a, b in zip(before, snapshot(*live)):
            assert_bitwise(f"{case}: state after a rejected call", a, b)
    backend_obj = ops.get_backend(backend)
    inv = torch.tensor(1.0, device=device)
    with pytest.raises(TypeError, match=r"grads\[1\] must have dtype"):
        backend_obj.norm_check([torch.ones(3, device=device), torch.ones(3, dtype=torch.int64, device=device)], inv)
    with pytest.raises(TypeError, match="grads must be a list"):
        backend_obj.unscale_(torch.ones(3, device=device), inv)
    with pytest.raises(TypeError, match="inv_scale must have dtype"):
        backend_obj.norm_check([torch.ones(3, device=device)], inv.double())
    with pytest.raises(TypeError, match="growth_tracker must have dtype"):
        backend_obj.update_scale_(inv.clone(), torch.tensor(0, device=device), torch.tensor(0.0, device=device),
                                  2.0, 0.5, 10)


def test_bad_input_rejected_before_kernels():
    check_bad_inputs("cpu", "cpu")


def test_master_overlapping_a_param_is_rejected():
    t = step_tensors("cpu")
    params = [t["master"][:64], t["params"][1].float()]  # fp32 parameters with a master
    with pytest.raises(ValueError, match=r"master and params\[0\] must not overlap"):
        ops.adam_step_(params, [torch.ones(64), torch.ones(8, 8)], t["master"], t["exp_avg"], t["exp_avg_sq"],
                       t["steps"], t["partials"], t["inv_scale"], t["lr"], t["out_stats"], backend="cpu")


# ---- torch.library ---------------------------------------------------------------------------------------------

def check_opcheck(device, backend):
    t = step_tensors(device, n=40)
    grads = [torch.randn(5, device=device), torch.randn(7, device=device).to(BF16)]
    inv = torch.tensor(0.5, device=device)
    o = torch.ops.ampfused
    torch.library.opcheck(o.norm_check.default, (grads, inv, backend))
    torch.library.opcheck(o.unscale_.default, ([g.clone() for g in grads], inv, backend))
    torch.library.opcheck(o.update_scale_.default, (torch.tensor(4.0, device=device),
                                                    torch.tensor(0, dtype=torch.int32, device=device),
                                                    torch.tensor(0.0, device=device), 2.0, 0.5, 1, None, None,
                                                    backend))
    torch.library.opcheck(o.update_scale_.default, (torch.tensor(4.0, device=device),
                                                    torch.tensor(0, dtype=torch.int32, device=device),
                                                    torch.tensor(1.0, device=device), 2.0, 0.5, 1,
                                                    torch.zeros((), device=device),
                                                    torch.zeros((), dtype=torch.int64, device=device), backend))
    with_none = [t["grads"][0], None]
    for grads_ in (t["grads"], with_none):
        torch.library.opcheck(o.adam_step_.default, (t["params"], grads_, t["master"], t["exp_avg"],
                                                     t["exp_avg_sq"], t["steps"], t["partials"], t["inv_scale"],
                                                     t["lr"], t["out_stats"], 0.9, 0.999, 1e-8, 0.01, 1.0, True,
                                                     False, backend, None, None))
        torch.library.opcheck(o.sgd_step_.default, (t["params"], grads_, t["master"], t["exp_avg"], t["steps"],
                                                    t["partials"], t["inv_scale"], t["lr"], t["out_stats"], 0.9, 0.0,
                                                    0.01, True, 1.0, False, backend, None, None))


def test_opcheck():
    check_opcheck("cpu", "cpu")


def test_traced_calls_pass_every_argument_of_the_custom_op():
    """A Python kernel of the custom op (a dispatch mode here; autograd's in-place kernel on torch before 2.13, which
    bumps each written argument by its position) sees every argument: the dispatcher dropped ``state_scales``
    when it was left to a default (IndexError on torch 2.11), so the step ops declare none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "ampfused":
                seen[func._schema.name] = (len(args), len(func._schema.arguments), sorted(kwargs or {}))
            return func(*args, **(kwargs or {}))

    t = step_tensors("cpu", n=40)
    with Record():
        ops.adamw_step_(t["params"], t["grads"], t["master"], t["exp_avg"], t["exp_avg_sq"], t["steps"],
                        t["partials"], t["inv_scale"], t["lr"], t["out_stats"], backend="cpu")
    given, declared, kw = seen["ampfused::adam_step_"]
    assert given == declared and not kw, seen
