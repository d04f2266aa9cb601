"""Whole state dicts of the ZeRO-1 optimizers, in torch.optim's layout.

``export_sharded`` gathers every rank's pieces into whole per-parameter tensors (one all-gather per state
buffer and dtype, one all-reduce of the step counts): the result is what :class:`ampfused.FusedAdamW` would save
for the same run, so it loads into any world size, into the unsharded fused optimizers and into torch's.
``import_sharded`` takes such a whole state dict and keeps this rank's pieces; it validates everything and
builds the new buffers aside before swapping them in, so a state dict that does not fit changes nothing.

Compact state (``docs/state-precision.md``) is exported in its storage precision under the unsharded optimizer's
keys (bf16 moments, int16 ``master_remainder``; 8-bit moments as uint8 codes shaped like the parameter and
``<name>_scale``, the fp32 scales of the parameter's own blocks), and imported as the unsharded optimizer imports
it: an fp32 checkpoint's moments are rounded to the moments' dtype (8-bit: encoded to nearest), 8-bit codes into
8-bit moments are kept bit for bit with their scales (a rank owns whole blocks of each parameter), into other
moments decoded exactly; its ``master_param`` becomes remainders (:func:`ampfused.optim._precision.remainders_from`).
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from ..ops import memory_view
from ..ops import state_precision as sp
from ..optim._precision import remainders_from
from ..optim._state import _codes_values, _packed_groups, _saved_scales, checked_entry, checked_groups, codes_renamed
from . import _comm as C
from ._layout import master_key, state_dtypes


def _whole(s, name: str, dtype: torch.dtype, group) -> Tensor:
    """All ranks' pieces of one state buffer (``name``, or the masters) of space ``s`` as one ``dtype`` tensor over
    the whole space."""
    local = torch.zeros(s.shard, dtype=dtype, device=s.comm.device)
    for seg in s.segments:
        flat = seg.master if name in ("master_param", "master_remainder") else seg.states.get(name)
        if flat is None:  # (a group whose step has not needed this state)
            continue
        for k in range(len(seg)):
            seg.shard_piece(local, k).copy_(seg.piece(flat, k))
    out = torch.empty(s.comm.numel(), dtype=dtype, device=s.comm.device)
    if dtype == torch.int16:  # gathered as bf16 bits (gloo has no int16; a gather moves bits unchanged)
        C.all_gather(out.view(torch.bfloat16), local.view(torch.bfloat16), group)
    else:
        C.all_gather(out, local, group)
    return out


def _whole_scales(s, name: str, group) -> Tensor:
    """All ranks' block scales of 8-bit moment ``name`` of space ``s``, one per block of the space (its parameters
    and shard cuts are at multiples of QBLOCK: parameter ``j``'s blocks start at ``offsets[j] // QBLOCK``)."""
    local = torch.zeros(s.shard // sp.QBLOCK, dtype=torch.float32, device=s.comm.device)
    for seg in s.segments:
        if name not in seg.states:
            continue
        for k in range(len(seg)):
            first = seg.shard_offsets[k] // sp.QBLOCK
            local[first:first + sp.q8_blocks(seg.lengths[k])].copy_(seg.scale_view(name, k))
    out = torch.empty(s.comm.numel() // sp.QBLOCK, dtype=torch.float32, device=s.comm.device)
    C.all_gather(out, local, group)
    return out


def export_sharded(opt) -> dict:
    groups, index = _packed_groups(opt)
    state: Dict[int, dict] = {}
    for s in opt._spaces:
        # per parameter: its step count, whether it has state, and which of the states its segments hold (SGD's
        # momentum only once a step needed it): reported by the owner of its first element
        names = opt.state_names
        steps = torch.zeros(2 + len(names), len(s.params), dtype=torch.float32, device=s.comm.device)
        for seg in s.segments:
            for k, (j, a) in enumerate(zip(seg.index, seg.starts)):
                if a == 0:
                    steps[0, j] = seg.steps[k]
                    steps[1, j] = float(seg.has_state[k])
                    for r, name in enumerate(names):
                        steps[2 + r, j] = float(name in seg.states)
        C.all_reduce_sum_(steps, opt.process_group)
        count, has, *held = steps.tolist()  # one read per dtype, at checkpoint time only
        if not any(has):
            continue
        names = [name for name, row in zip(names, held) if any(row)]  # (the same on every rank)
        master, moments = state_dtypes(opt._precision, s.dtype, opt._use_master(s.dtype))
        dtypes = dict.fromkeys(names, moments)
        if master is not None:
            dtypes[master_key(master)] = master
        whole = {name: _whole(s, name, dtype, opt.process_group) for name, dtype in dtypes.items()}
        scales = ({name: _whole_scales(s, name, opt.process_group) for name in names}
                  if moments == torch.uint8 else {})
        for j, p in enumerate(s.params):
            if not has[j]:
                continue
            mine = [name for name, row in zip(opt.state_names, held) if row[j]]
            st = {name: whole[name].as_strided(p.shape, p.stride(), s.offsets[j]).clone() for name in mine}
            first = s.offsets[j] // sp.QBLOCK
            st.update({f"{name}_scale": scales[name][first:first + sp.q8_blocks(p.numel())].clone()
                       for name in mine if name in scales})
            st.update({name: whole[name].as_strided(p.shape, p.stride(), s.offsets[j]).clone()
                       for name in dtypes if name not in opt.state_names})
            state[index[id(p)]] = codes_renamed(opt._export_param_state(st, count[j]), opt.state_names)
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
                _check_remainder(entry[0], p, sid_of[id(p)])
                entries[id(p)] = entry

    def in_memory_order(v: Tensor, p: Tensor) -> Tensor:
        out = torch.empty_like(p, dtype=v.dtype)  # p's strides: memory order is p's
        out.copy_(v.reshape(p.shape))
        return memory_view(out)

    sources: Dict[tuple, tuple] = {}

    def moment(key: str, e: dict, p: Tensor, q8: bool) -> tuple:
        """Saved moment ``e[key]`` of ``p`` in ``p``'s memory order as this optimizer stores it, once per parameter:
        ``(codes, block scales)`` for 8-bit moments (saved codes kept bit for bit when their blocks follow ``p``'s
        memory order, as the unsharded optimizer keeps them; else the values encoded to nearest), ``(values,
        None)`` otherwise (saved codes decoded exactly)."""
        if (id(p), key) not in sources:
            v = e[key]
            coded = v.dtype == torch.uint8
            # (block scales, or FSDP2's per-element exponents where each block has one; else None)
            saved = _saved_scales(key, e, v.numel()) if q8 and coded else None
            if saved is not None and (v.stride() == p.stride() or v.is_contiguous() and p.is_contiguous()):
                codes = memory_view(v) if not v.is_contiguous() else v.reshape(-1)
                sources[id(p), key] = codes.to(p.device), saved.to(p.device)
            else:
                values = in_memory_order(_codes_values(key, e) if coded else v, p)
                sources[id(p), key] = sp.q8_quantize(values.float(), sp.q8_signed(key)) if q8 else (values, None)
        return sources[id(p), key]

    built, relaid = [], {}
    with torch.no_grad():
        for s in opt._spaces:
            for seg in s.segments:
                # a segment without a state the checkpoint holds (SGD's momentum before a step had momentum): one
                # laid out for it takes its place
                loaded = [key for j in seg.index if id(s.params[j]) in entries for key in entries[id(s.params[j])][1]]
                if any(key not in seg.states for key in loaded):
                    relaid[id(seg)] = seg = seg.with_states(loaded)
                states = {name: torch.zeros_like(flat) for name, flat in seg.states.items()}
                scales = torch.zeros_like(seg.scales) if seg.scales is not None else None
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
                            src, src_scales = moment(key, e, p, scales is not None)
                            seg.piece(states[key], k).copy_(src[a:a + n])
                            if src_scales is not None:  # the piece's blocks: a is a multiple of QBLOCK
                                first = a // sp.QBLOCK
                                seg.scale_view(key, k, scales).copy_(src_scales[first:first + sp.q8_blocks(n)])
                    e = entry[0] if entry is not None else {}
                    if master is not None and master.dtype == torch.int16:  # remainders
                        if e.get("master_remainder") is not None:
                            seg.piece(master, k).copy_(in_memory_order(e["master_remainder"], p)[a:a + n])
                        elif e.get("master_param") is not None:
                            fp32 = in_memory_order(e["master_param"].float(), p)[a:a + n]
                            seg.piece(master, k).copy_(remainders_from(fp32, seg.param_piece(k)))
                    elif master is not None:
                        src = e.get("master_param")
                        seg.piece(master, k).copy_(in_memory_order(src, p)[a:a + n] if src is not None
                                                   else seg.param_piece(k))
                steps = torch.tensor(steps, dtype=torch.float32).to(seg.steps.device)
                built.append((seg, states, scales, master, steps, has))
    for s in opt._spaces:
        s.segments = [relaid.get(id(seg), seg) for seg in s.segments]
    for seg, states, scales, master, steps, has in built:
        seg.states, seg.scales, seg.master, seg.steps, seg.has_state = states, scales, master, steps, has
        seg.lr_value = None
    for g, ng in zip(groups, new_groups):
        g.update(ng)


def _check_remainder(e: dict, p: Tensor, sid) -> None:
    """A loaded ``master_remainder`` (checked on every rank, whichever owns it): int16, one per element of ``p``."""
    v = e.get("master_remainder")
    if v is None:
        return
    if not isinstance(v, Tensor) or v.dtype != torch.int16 or v.numel() != p.numel():
        found = f"{v.dtype} of shape {tuple(v.shape)}" if isinstance(v, Tensor) else type(v).__name__
        raise ValueError(f"loaded state 'master_remainder' of parameter {sid} must be an int16 tensor with "
                         f"{p.numel()} elements like the parameter (shape {tuple(p.shape)}), got {found}")
