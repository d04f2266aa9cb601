"""Whole state dicts of the ZeRO-1 optimizers, in torch.optim's layout.

``export_sharded`` gathers every rank's pieces into whole per-parameter tensors (one all-gather per state
buffer and dtype, one all-reduce of the step counts): the result is what :class:`ampfused.FusedAdamW` would save
for the same run, so it loads into any world size, into the unsharded fused optimizers and into torch's.
``import_sharded`` takes such a whole state dict and keeps this rank's pieces; it validates everything and
builds the new buffers aside before swapping them in, so a state dict that does not fit changes nothing.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from ..ops import memory_view
from ..optim._state import _packed_groups, checked_entry, checked_groups
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
    groups = opt.param_groups
    saved_state, sid_of, new_groups = checked_groups(opt, state_dict)
    # every parameter's entry is checked on every rank, so all ranks accept or refuse the same state dict
    entries: Dict[int, tuple] = {}
    for s in opt._spaces:
        for p in s.params:
            entry = checked_entry(opt, saved_state, sid_of[id(p)], p)
            if entry is not None:
                entries[id(p)] = entry

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
