"""Whole state dicts of the ZeRO-1 optimizers, in torch.optim's layout.

``export_sharded`` gathers every rank's pieces into whole per-parameter tensors (one all-gather per state
buffer and dtype, one all-reduce of the step counts): the result is what :class:`ampfused.FusedAdamW` would save
for the same run, so it loads into any world size, into the unsharded fused optimizers and into torch's.
``import_sharded`` takes such a whole state dict and keeps this rank's pieces; it validates everything and
builds the new buffers aside before swapping them in, so a state dict that does not fit changes nothing.
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import Tensor

from ..ops import memory_view
from ..optim import _params as P
from ..optim._state import _check_value, _packed_groups, _saved_step
from . import _comm as C


def _whole(s, name: str, group) -> Tensor:
    """All ranks' pieces of one state buffer (``name``, or the masters) of space ``s`` as one fp32 tensor over the
    whole space."""
    local = torch.zeros(s.shard, dtype=torch.float32, device=s.comm.device)
    for seg in s.segments:
        flat = seg.master if name == "master_param" else seg.states[name]
        for k in range(len(seg)):
            seg.shard_piece(local, k).copy_(seg.piece(flat, k))
    out = torch.empty(s.comm.numel(), dtype=torch.float32, device=s.comm.device)
    C.all_gather(out, local, group)
    return out


def export_sharded(opt) -> dict:
    groups, index = _packed_groups(opt)
    state: Dict[int, dict] = {}
    for s in opt._spaces:
        steps = torch.zeros(2, len(s.params), dtype=torch.float32, device=s.comm.device)
        for seg in s.segments:
            for k, (j, a) in enumerate(zip(seg.index, seg.starts)):
                if a == 0:  # the owner of a parameter's first element reports its step count
                    steps[0, j] = seg.steps[k]
                    steps[1, j] = float(seg.has_state[k])
        C.all_reduce_sum_(steps, opt.process_group)
        count, has = steps.tolist()  # one read per dtype, at checkpoint time only
        if not any(has):
            continue
        names = list(opt.state_names) + (["master_param"] if opt._use_master(s.dtype) else [])
        whole = {name: _whole(s, name, opt.process_group) for name in names}
        for j, p in enumerate(s.params):
            if not has[j]:
                continue
            st = {name: flat.as_strided(p.shape, p.stride(), s.offsets[j]).clone() for name, flat in whole.items()}
            state[index[id(p)]] = opt._export_param_state(st, count[j])
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def import_sharded(opt, state_dict: dict) -> None:
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("optimizer state_dict must be a dict with keys 'state' and 'param_groups'")
    groups, saved_groups = opt.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                         "optimizer's group")
    saved_state = state_dict["state"]
    if not isinstance(saved_state, dict):
        raise ValueError("optimizer state_dict['state'] must be a dict from parameter index to its state")
    sid_of = {id(p): sid for g, s in zip(groups, saved_groups) for sid, p in zip(s["params"], g["params"])}

    new_groups: List[dict] = []
    for gi, (g, s) in enumerate(zip(groups, saved_groups)):
        ng = dict(g)
        ng.update({k: v for k, v in s.items() if k != "params"})
        where = f" in loaded param_groups[{gi}]"
        opt._validate_group(ng, where)
        P.check_lr(ng["lr"], where)
        new_groups.append(ng)
    # every parameter's entry is checked on every rank, so all ranks accept or refuse the same state dict
    entries: Dict[int, tuple] = {}
    for s in opt._spaces:
        for p in s.params:
            e = saved_state.get(sid_of[id(p)])
            if not e:
                continue
            where = f"parameter {sid_of[id(p)]}"
            if not isinstance(e, dict):
                raise ValueError(f"loaded state of {where} must be a dict, got {type(e).__name__}")
            keys = list(opt._state_keys_for_load(e))
            missing = [k for k in keys if k not in e]
            if missing:
                raise ValueError(f"loaded state of {where} lacks {missing}")
            for key in keys + (["master_param"] if "master_param" in e else []):
                _check_value(key, e[key], p, where)
            entries[id(p)] = (e, keys, _saved_step(opt, e, where))

    def in_memory_order(v: Tensor, p: Tensor) -> Tensor:
        out = torch.empty_like(p, dtype=torch.float32)  # p's strides: memory order is p's
        out.copy_(v.reshape(p.shape))
        return memory_view(out)

    built = []
    with torch.no_grad():
        for s in opt._spaces:
            for seg in s.segments:
                states = {name: torch.zeros_like(flat) for name, flat in seg.states.items()}
                master = torch.zeros_like(seg.master) if seg.master is not None else None
                steps, has = [0.0] * len(seg), [False] * len(seg)
                for k, j in enumerate(seg.index):
                    p = s.params[j]
                    entry = entries.get(id(p))
                    a, n = seg.starts[k], seg.lengths[k]
                    if entry is not None:
                        e, keys, steps[k] = entry
                        has[k] = True
                        for key in keys:
                            seg.piece(states[key], k).copy_(in_memory_order(e[key], p)[a:a + n])
                    if master is not None:
                        src = entry[0].get("master_param") if entry is not None else None
                        seg.piece(master, k).copy_(in_memory_order(src, p)[a:a + n] if src is not None
                                                   else seg.param_piece(k))
                built.append((seg, states, master, torch.tensor(steps, dtype=torch.float32).to(seg.steps.device), has))
    for seg, states, master, steps, has in built:
        seg.states, seg.master, seg.steps, seg.has_state = states, master, steps, has
        seg.lr_value = None
    for g, ng in zip(groups, new_groups):
        g.update(ng)
