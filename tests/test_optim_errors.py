"""Bad input to the fused optimizers fails with a message naming the argument and rule, changing nothing."""
import math

import pytest
import torch

import ampfused


def _params():
    return [torch.randn(4, 3, dtype=torch.bfloat16, requires_grad=True), torch.randn(3, requires_grad=True)]


CASES = [
    (ampfused.FusedAdamW, dict(lr=-1e-3), ValueError, "Invalid learning rate: -0.001"),
    (ampfused.FusedAdamW, dict(lr=math.nan), ValueError, "Invalid learning rate: nan"),
    (ampfused.FusedAdam, dict(betas=(1.0, 0.999)), ValueError, "Invalid beta parameter at index 0: 1.0"),
    (ampfused.FusedAdam, dict(betas=(0.9, -0.1)), ValueError, "Invalid beta parameter at index 1: -0.1"),
    (ampfused.FusedAdamW, dict(eps=-1.0), ValueError, "Invalid epsilon value: -1.0"),
    (ampfused.FusedAdamW, dict(weight_decay=-0.1), ValueError, "Invalid weight_decay value: -0.1"),
    (ampfused.FusedAdamW, dict(max_grad_norm=0.0), ValueError, "Invalid max_grad_norm: 0.0"),
    (ampfused.FusedAdamW, dict(max_grad_norm=-1.0), ValueError, "Invalid max_grad_norm: -1.0"),
    (ampfused.FusedAdamW, dict(max_grad_norm=math.nan), ValueError, "Invalid max_grad_norm: nan"),
    (ampfused.FusedSGD, dict(lr=0.1, momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),
    (ampfused.FusedSGD, dict(lr=0.1, nesterov=True), ValueError, "Nesterov momentum requires a momentum"),
    (ampfused.FusedSGD, dict(lr=0.1, weight_decay=-1.0), ValueError, "Invalid weight_decay value: -1.0"),
    (ampfused.FusedAdamW, dict(master_weights=False), ValueError, "master_weights=False with a torch.bfloat16"),
    (ampfused.FusedAdamW, dict(backend="nope"), ValueError, "unknown ampfused backend 'nope'"),
]


@pytest.mark.parametrize("cls,kw,exc,msg", CASES, ids=[c[3][:30] for c in CASES])
def test_invalid_hyperparameters(cls, kw, exc, msg):
    params = _params()
    ptrs = [p.data_ptr() for p in params]
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        cls(params, **kw)
    assert [p.data_ptr() for p in params] == ptrs  # nothing was flattened


def test_matches_torch_messages_for_shared_rules():
    for kw in [dict(lr=-1.0), dict(eps=-1.0), dict(betas=(1.5, 0.9)), dict(weight_decay=-1.0)]:
        with pytest.raises(ValueError) as ours:
            ampfused.FusedAdamW(_params(), **kw)
        with pytest.raises(ValueError) as theirs:
            torch.optim.AdamW(_params(), **kw)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("bad,exc,msg", [
    (lambda: torch.zeros(3, dtype=torch.int64), TypeError, "has dtype torch.int64"),
    (lambda: torch.zeros(3, dtype=torch.complex64), TypeError, "has dtype torch.complex64"),
    (lambda: torch.zeros(3, dtype=torch.float64), TypeError, "has dtype torch.float64"),
    (lambda: torch.sparse_coo_tensor([[0]], [1.0], (3,)), TypeError, "is sparse"),
    (lambda: torch.randn(2, requires_grad=True) * 2, ValueError, "can't optimize a non-leaf Tensor"),
])
def test_invalid_parameters_fail_before_any_change(bad, exc, msg):
    good = _params()
    ptrs = [p.data_ptr() for p in good]
    with pytest.raises(exc, match=msg):
        ampfused.FusedAdamW(good + [bad()])
    assert [p.data_ptr() for p in good] == ptrs


def test_parameters_on_several_devices_fail_at_the_step_before_any_change():
    good = _params()
    opt = ampfused.FusedAdamW(good + [torch.zeros(3, device="meta", requires_grad=True)])
    for p in good:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in good]
    with pytest.raises(ValueError, match=r"parameters must all be on one device, but .* is on cpu; "
                                         r".*\['params'\]\[2\] \(shape \(3,\)\) is on meta"):
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, good)) and not opt.state


def test_duplicate_parameters():
    """torch.optim's rules: a repeat inside a group warns, a repeat across groups raises (tests/torch_suite has
    the step's behaviour)."""
    p = _params()
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        ampfused.FusedSGD(p + [p[0]], lr=0.1)
    with pytest.raises(ValueError, match="^some parameters appear in more than one parameter group$"):
        ampfused.FusedSGD([{"params": p[:1]}, {"params": p[:1]}], lr=0.1)


def test_empty_and_tensor_params():
    with pytest.raises(ValueError, match="empty parameter list"):
        ampfused.FusedAdamW([])
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
        ampfused.FusedAdamW(torch.randn(3, requires_grad=True))


def test_functional_ops_name_the_tensor_and_rule():
    from ampfused import ops
    n = 8
    p = torch.randn(n, dtype=torch.bfloat16)
    args = dict(param=p, grad=torch.randn(n, dtype=torch.bfloat16), master=p.float(), exp_avg=torch.zeros(n),
                exp_avg_sq=torch.zeros(n), step=torch.zeros(()), partials=torch.zeros(2, 1),
                inv_scale=torch.ones(()), lr=torch.tensor(1e-3), out_stats=torch.zeros(2))

    def call(**over):
        a = dict(args, **over)
        ops.adamw_step_(a["param"], a["grad"], a["master"], a["exp_avg"], a["exp_avg_sq"], a["step"],
                        a["partials"], a["inv_scale"], a["lr"], a["out_stats"])

    with pytest.raises(ValueError, match=r"grads\[0\] \(shape \(7,\), stride \(1,\)\) must have the shape and "
                                         r"memory layout of params\[0\] \(shape \(8,\)"):
        call(grad=torch.randn(7, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"exp_avg must have dtype in \['torch.float32'\]"):
        call(exp_avg=torch.zeros(n, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="master must be contiguous"):
        call(master=torch.zeros(2 * n)[::2])
    with pytest.raises(ValueError, match="needs an fp32 master"):
        call(master=None)
    with pytest.raises(ValueError, match=r"partials must have shape \[2, P\]"):
        call(partials=torch.zeros(3))
    with pytest.raises(ValueError, match=r"steps must be a contiguous 1-D tensor with one step count per "
                                         r"parameter \(1\), got shape \(2,\)"):
        call(step=torch.zeros(2))
    with pytest.raises(ValueError, match=r"exp_avg must have 8 elements, got 9"):
        call(exp_avg=torch.zeros(n + 1))
    with pytest.raises(ValueError, match="beta1 must be finite"):
        ops.adamw_step_(*args.values(), beta1=math.inf)
    assert torch.equal(args["exp_avg"], torch.zeros(n))
