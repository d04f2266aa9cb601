"""State dicts of the fused optimizers in torch.optim's layout, so checkpoints move both ways.

``state[i]`` holds, per parameter, the optimizer's state tensors shaped like the parameter (fp32), a
``master_param`` where master weights exist and a CPU ``step`` tensor, as torch's optimizers do. Loading
validates everything first and changes nothing unless all of it fits.
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import Tensor


def export_state_dict(opt) -> dict:
    """``opt.state_dict()``: torch's layout, state tensors as views of the live buffers (as torch does)."""
    sd = torch.optim.Optimizer.state_dict(opt)
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    state: Dict[int, dict] = {}
    for seg in opt._segments:
        step = float(seg.step.item())  # one read per segment, at checkpoint time only
        for p in seg.flat.params:
            st = {k: v for k, v in opt.state[p].items() if k != "step"}
            state[index[id(p)]] = opt._export_param_state(st, step)
    sd["state"] = state
    return sd


def _saved_step(opt, saved: dict, where: str) -> float:
    try:
        return opt._import_step(saved)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"loaded optimizer state of {where} has no usable step ({e})") from None


def import_state_dict(opt, state_dict: dict) -> None:
    """``opt.load_state_dict(sd)`` from ours or from torch.optim's matching optimizer."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("optimizer state_dict must be a dict with keys 'state' and 'param_groups'")
    groups, saved_groups = opt.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                         "optimizer's group")
    by_id = {sid: p for g, s in zip(groups, saved_groups) for sid, p in zip(s["params"], g["params"])}
    saved_state = state_dict["state"]

    # Validate everything before changing anything.
    new_groups: List[dict] = []
    for g, s in zip(groups, saved_groups):
        ng = dict(g)
        ng.update({k: v for k, v in s.items() if k != "params"})
        opt._validate_group(ng)
        new_groups.append(ng)
    plans = []
    for seg in opt._segments:
        sid_of = {id(p): sid for sid, p in by_id.items()}
        entries = [(p, saved_state.get(sid_of[id(p)])) for p in seg.flat.params]
        have = [(p, e) for p, e in entries if e]
        if have and len(have) != len(entries):
            raise ValueError("loaded state dict has state for only some parameters of a group; fused optimizers "
                             "keep one step count per parameter group")
        steps = {_saved_step(opt, e, f"parameter {sid_of[id(p)]}") for p, e in have}
        if len(steps) > 1:
            raise ValueError(f"loaded state dict has different step counts {sorted(steps)} within one parameter "
                             "group; fused optimizers keep one step count per parameter group")
        for p, e in have:
            for key in list(opt._state_keys_for_load(e)) + (["master_param"] if "master_param" in e else []):
                v = e[key]
                if not isinstance(v, Tensor) or v.numel() != p.numel():
                    raise ValueError(f"loaded state '{key}' of parameter {sid_of[id(p)]} must be a tensor with "
                                     f"{p.numel()} elements like the parameter, got "
                                     f"{tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__}")
                if not v.is_floating_point():
                    raise ValueError(f"loaded state '{key}' of parameter {sid_of[id(p)]} has dtype {v.dtype}")
        plans.append((seg, have, steps.pop() if steps else 0.0))

    with torch.no_grad():
        for seg, have, step in plans:
            for buf in seg.states.values():
                buf.zero_()
            for p, e in have:
                st = opt.state[p]
                for key in opt._state_keys_for_load(e):
                    st[key].copy_(e[key].reshape(st[key].shape))
                if seg.master is not None:
                    src = e.get("master_param", p.detach())
                    st["master_param"].copy_(src.reshape(p.shape))
            if not have and seg.master is not None:
                seg.master.copy_(seg.flat.data)  # no saved state: masters follow the (re)loaded model weights
            seg.step.fill_(step)
            seg.lr_value = None
    for g, ng in zip(groups, new_groups):
        g.update(ng)
