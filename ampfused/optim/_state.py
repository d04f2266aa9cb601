"""State dicts of the fused optimizers in torch.optim's layout, so checkpoints move both ways.

``state[i]`` holds, for each parameter that has state, the optimizer's state tensors shaped (and strided)
like the parameter (fp32), a ``master_param`` where master weights exist and a CPU ``step`` tensor, as
torch's optimizers do. Loading validates everything first, builds the new buffers aside and swaps them in
only when all of it fits: a state dict that does not fit leaves the optimizer exactly as it was.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional

import torch
from torch import Tensor

from . import _params as P
from ..ops import memory_view
from ..ops import state_precision as sp
from ._precision import master_key, remainders_from
from ._segment import build_segment, is_dtensor, local


class ParamState(dict):
    """``optimizer.state[p]``: views of the fused optimizer's buffers. Assigning a tensor to one of its keys
    (as frameworks do when they move optimizer state between devices) copies the values into the buffer, so
    the optimizer keeps using what was assigned."""

    def __setitem__(self, key, value):
        mine = self.get(key)
        if isinstance(mine, Tensor) and isinstance(value, Tensor) and value is not mine:
            mine, value = local(mine), local(value)  # a sharded parameter's state: this rank's shard
            if value.numel() != mine.numel():
                raise ValueError(f"optimizer state '{key}' must keep {mine.numel()} elements, got a tensor of shape "
                                 f"{tuple(value.shape)}")
            with torch.no_grad():
                mine.copy_(value.reshape(mine.shape))
            return
        super().__setitem__(key, value)

    def _bind(self, values: Dict[str, Tensor]) -> None:
        for k, v in values.items():
            dict.__setitem__(self, k, v)


class _StateMap(defaultdict):
    """``optimizer.state``: replacing a parameter's whole state dict copies its tensors into the buffers."""

    def __setitem__(self, key, value):
        mine = self.get(key)
        if isinstance(mine, ParamState) and isinstance(value, dict) and value is not mine:
            for k, v in value.items():
                mine[k] = v
            return
        super().__setitem__(key, value)


CODES = "_codes"  # the state dict's key suffix of 8-bit moments' codes


def codes_renamed(entry: dict, names) -> dict:
    """An exported entry with each 8-bit moment's codes (``optimizer.state[p][name]``, uint8) under
    ``<name>_codes``: a loader that knows only moments' values (torch.optim's, which casts every state tensor
    to the parameter's dtype) then finds no ``<name>`` and fails, instead of taking codes 0-255 for values."""
    return {(f"{k}{CODES}" if k in names and isinstance(v, Tensor) and v.dtype == torch.uint8 else k): v
            for k, v in entry.items()}


def _codes_as_moments(e: dict, names, where: str) -> dict:
    """A loaded entry with each ``<name>_codes`` under ``<name>``, as the optimizer holds it (a checkpoint
    written before the codes had their own key holds them there already)."""
    coded = [n for n in names if f"{n}{CODES}" in e]
    for n in coded:
        v = e[f"{n}{CODES}"]
        if n in e:
            raise ValueError(f"loaded state of {where} has both '{n}' and '{n}{CODES}' (its 8-bit codes): keep one")
        if not isinstance(v, Tensor) or v.dtype != torch.uint8:
            raise ValueError(f"loaded state '{n}{CODES}' of {where} must be the uint8 codes of 8-bit moments, got "
                             f"{v.dtype if isinstance(v, Tensor) else type(v).__name__}")
    if not coded:
        return e
    out = {k: v for k, v in e.items() if k not in {f"{n}{CODES}" for n in coded}}
    out.update({n: e[f"{n}{CODES}"] for n in coded})
    return out


def _packed_groups(opt) -> tuple:
    """torch.optim's ``param_groups`` export (parameters as indices) and ``id(param) -> index``."""
    index: Dict[int, int] = {}
    groups = []
    start = 0
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        index.update({id(p): i for i, p in enumerate(g["params"], start) if id(p) not in index})
        packed["params"] = [index[id(p)] for p in g["params"]]
        start += len(packed["params"])
        groups.append(packed)
    return groups, index


def export_state_dict(opt) -> dict:
    """``opt.state_dict()``: torch's layout, state tensors as views of the live buffers (as torch does)."""
    groups, index = _packed_groups(opt)
    state: Dict[int, dict] = {}
    for seg in opt._segs.segments:
        if not any(seg.has_state):
            continue
        steps = seg.steps.tolist()  # one read per segment, at checkpoint time only
        group = opt.param_groups[seg.group_index]
        for i, p in enumerate(seg.params):
            if seg.has_state[i]:
                st = seg.state_views(i)  # (8-bit moments: codes and their block scales)
                if seg.sharded and getattr(seg, "scales", None) is not None:
                    # FSDP2: the scales as per-element exponents placed like the parameter, so DCP reshards them
                    for name in seg.states:
                        del st[f"{name}_scale"]
                        st[f"{name}_exponent"] = seg.exponents(name, i)
                if seg.master is not None:
                    st[master_key(seg)] = seg.state_view(seg.master, i)
                entry = codes_renamed(opt._export_param_state(st, steps[i], group), opt.state_names)
                if entry:  # (torch.optim.SGD without momentum keeps no state)
                    state[index[id(p)]] = entry
    # what is not a parameter's state (keys that hooks or users put in optimizer.state) is kept as torch keeps it
    state.update({k: v for k, v in opt.state.items() if not isinstance(k, Tensor)})
    return {"state": state, "param_groups": groups}


def state_dict_with_hooks(opt, export) -> dict:
    """``opt.state_dict()``: torch's pre-hooks, ``export(opt)``, the spike guard's state (an extra key that
    torch's optimizers ignore on load), torch's post-hooks."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    sd = export(opt)
    if opt.spike_guard is not None:
        sd["spike_guard"] = opt.spike_guard.state_dict()
    for hook in opt._optimizer_state_dict_post_hooks.values():
        out = hook(opt, sd)
        sd = out if out is not None else sd
    return sd


def run_load_pre_hooks(opt, state_dict: dict) -> dict:
    """torch's load-state-dict pre-hooks (each may hand back a new state dict), given a shallow copy of the
    caller's dict as torch gives them, so a hook that edits the dict does not change the caller's."""
    state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        out = hook(opt, state_dict)
        state_dict = out if out is not None else state_dict
    return state_dict


def _saved_step(opt, saved: dict, where: str) -> float:
    try:
        return opt._import_step(saved)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"loaded optimizer state of {where} has no usable step ({e})") from None


def _check_value(key: str, v, p: Tensor, where: str, codes: bool = False) -> None:
    if not isinstance(v, Tensor):
        raise ValueError(f"loaded state '{key}' of {where} must be a tensor, got {type(v).__name__}")
    if is_dtensor(p):
        if not is_dtensor(v) or v.placements != p.placements or v.device_mesh != p.device_mesh:
            found = f"placed {v.placements} on {v.device_mesh}" if is_dtensor(v) else "a plain tensor"
            raise ValueError(f"loaded state '{key}' of {where} is {found}, but the parameter is a DTensor placed "
                             f"{p.placements} on {p.device_mesh}: load sharded optimizer state with "
                             "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict (or give DTensors "
                             "placed like the parameters)")
        if tuple(v.shape) != tuple(p.shape):
            raise ValueError(f"loaded state '{key}' of {where} must have the parameter's shape {tuple(p.shape)}, got "
                             f"{tuple(v.shape)}")
        v, p = v._local_tensor, p._local_tensor
    if v.numel() != p.numel():
        raise ValueError(f"loaded state '{key}' of {where} must have {p.numel()} elements like the parameter "
                         f"(shape {tuple(p.shape)}), got shape {tuple(v.shape)}")
    if not v.is_floating_point() and not (codes and v.dtype == torch.uint8):
        raise ValueError(f"loaded state '{key}' of {where} has dtype {v.dtype}; optimizer states are floating point "
                         "(or uint8 8-bit moment codes with their block scales)")
    if v.is_meta:
        raise ValueError(f"loaded state '{key}' of {where} is a meta tensor (it holds no values)")
    if v.layout != torch.strided:
        raise ValueError(f"loaded state '{key}' of {where} has layout {v.layout}; optimizer states are dense")


def checked_groups(opt, state_dict: dict) -> tuple:
    """The parts of a state dict to load, its groups checked against ``opt``'s (nothing changed yet):
    ``(saved state, id(param) -> saved index, the param groups as they will be)``."""
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
        # a key the saved group lacks (an older torch's state dict) takes the value torch's __setstate__ gives it
        ng.update({k: v for k, v in getattr(opt, "torch_load_defaults", {}).items() if k not in s})
        ng.update({k: v for k, v in s.items() if k != "params"})
        where = f" in loaded param_groups[{gi}]"
        opt._validate_group(ng, where)
        P.check_lr(ng["lr"], where)
        new_groups.append(ng)
    return saved_state, sid_of, new_groups


def checked_entry(opt, saved_state: dict, sid, p: Tensor, group: Optional[dict] = None):
    """Parameter ``p``'s saved state (index ``sid``; ``group``: the param group it is in, when the optimizer's
    groups keep different states), checked: ``(entry, state keys, step)``, or None when it has none."""
    e = saved_state.get(sid)
    if not e:
        return None
    where = f"parameter {sid}"
    if not isinstance(e, dict):
        raise ValueError(f"loaded state of {where} must be a dict, got {type(e).__name__}")
    e = _codes_as_moments(e, opt.state_names, where)
    keys = list(opt._state_keys_for_load(e) if group is None else opt._state_keys_for_load(e, group))
    missing = [k for k in keys if k not in e]
    if missing:
        raise ValueError(f"loaded state of {where} lacks {missing}")
    for key in keys + (["master_param"] if "master_param" in e else []):
        _check_value(key, e[key], p, where, codes=key in keys)
        if key in keys and e[key].dtype == torch.uint8:
            _check_codes(key, e, p, where)
    return e, keys, _saved_step(opt, e, where)


def _check_codes(key: str, e: dict, p: Tensor, where: str) -> None:
    """8-bit moment codes ``e[key]``: in the parameter's memory order (its strides, or contiguous), with their
    block scales ``e[key + '_scale']`` (fp32, one per block of QBLOCK of the parameter's elements, each zero or
    a power of two in the format's range), or (FSDP2's form) each element's block exponent
    ``e[key + '_exponent']`` (uint8 with the codes' shape, strides and placement; 0 or in the format's range)."""
    v, pl = local(e[key]), local(p)
    if v.stride() != pl.stride() and not v.is_contiguous():
        raise ValueError(f"loaded state '{key}' of {where} holds 8-bit codes, which must keep the parameter's "
                         f"strides {pl.stride()} or be contiguous (their blocks follow memory order), got strides "
                         f"{v.stride()}")
    xkey = f"{key}_exponent"
    if xkey in e:
        _check_value(xkey, e[xkey], p, where, codes=True)
        x = local(e[xkey])
        if x.dtype != torch.uint8 or x.stride() != v.stride():
            raise ValueError(f"loaded state '{xkey}' of {where} must be uint8 block exponents with the codes' strides "
                             f"{v.stride()}, got {x.dtype} with strides {x.stride()}")
        f = x.detach().to(torch.int64)
        ok = (f == 0) | ((f >= sp.Q8_MIN_EXP) & (f <= sp.Q8_MAX_EXP))
        if not bool(ok.all()):
            raise ValueError(f"loaded state '{xkey}' of {where} must hold 0 or block exponents in [{sp.Q8_MIN_EXP}, "
                             f"{sp.Q8_MAX_EXP}], got {int(f[~ok][0])}")
        return
    skey = f"{key}_scale"
    s = e.get(skey)
    if not isinstance(s, Tensor):
        raise ValueError(f"loaded state '{key}' of {where} holds 8-bit codes (uint8) and needs their block scales "
                         f"'{skey}' (a float32 tensor), got {type(s).__name__}")
    blocks = sp.q8_blocks(pl.numel())
    if s.dtype != torch.float32 or s.is_meta or s.layout != torch.strided or s.dim() != 1 or s.numel() != blocks:
        raise ValueError(f"loaded state '{skey}' of {where} must be a float32 tensor of shape ({blocks},) (one scale "
                         f"per block of {sp.QBLOCK} of the parameter's elements), got {s.dtype} of shape "
                         f"{tuple(s.shape)}")
    bits = s.detach().cpu().view(torch.int32).to(torch.int64) & sp.M32
    exponent = (bits >> 23) & 0xFF
    ok = (bits == 0) | (((bits & 0x807FFFFF) == 0) & (exponent >= sp.Q8_MIN_EXP) & (exponent <= sp.Q8_MAX_EXP))
    if not bool(ok.all()):
        bad = s.detach().cpu()[~ok][0].item()
        raise ValueError(f"loaded state '{skey}' of {where} must hold zeros or powers of two 2**k with k in "
                         f"[{sp.Q8_MIN_EXP - 127}, {sp.Q8_MAX_EXP - 127}] (block scales of 8-bit moments), got {bad}")


def _in_memory_order(v: Tensor) -> Tensor:
    return memory_view(v) if not v.is_contiguous() else v.reshape(-1)


def _block_fields(key: str, e: dict) -> Optional[Tensor]:
    """Loaded per-element block exponents ``e[key + '_exponent']`` in memory order (int64), when given so."""
    x = e.get(f"{key}_exponent")
    return None if x is None else _in_memory_order(local(x)).to(torch.int64)


def _codes_values(key: str, e: dict) -> Tensor:
    """The fp32 values of loaded 8-bit codes ``e[key]`` (checked by :func:`_check_codes`), shaped like them."""
    v = local(e[key])
    flat = _in_memory_order(v)
    fields = _block_fields(key, e)
    if fields is not None:  # each element with its own block's exponent
        values = sp.q8_decode(flat, torch.clamp(fields.to(v.device), sp.Q8_MIN_EXP, sp.Q8_MAX_EXP),
                              sp.q8_signed(key))
    else:
        values = sp.q8_dequantize(flat, e[f"{key}_scale"].to(v.device), sp.q8_signed(key))
    return values.as_strided(v.shape, v.stride()) if not v.is_contiguous() else values.view(v.shape)


def _saved_scales(key: str, e: dict, n: int) -> Optional[Tensor]:
    """The block scales of loaded codes of ``n`` elements: ``e[key + '_scale']``, or from per-element exponents
    when every block of QBLOCK (from the first element, in memory order) has one exponent; else None (the
    blocks the codes were encoded in are not this layout's: their values are re-encoded)."""
    fields = _block_fields(key, e)
    if fields is None:
        return e[f"{key}_scale"]
    first = fields[::sp.QBLOCK]
    if not bool((fields == first.repeat_interleave(sp.QBLOCK)[:n]).all()):
        return None
    return sp.q8_scale(first)


def _load_moment(seg, i: int, key: str, e: dict, p: Tensor, states: dict, scales) -> None:
    """Saved moment ``e[key]`` into parameter ``i``'s slice of the new ``states`` (and ``scales``): 8-bit codes
    into 8-bit moments bit for bit (kept with their scales), else as values (codes decoded exactly, then 8-bit
    moments encoded to nearest, bf16 rounded to nearest even)."""
    v = local(e[key])
    mine = seg.view(states[key], i)
    saved = _saved_scales(key, e, v.numel()) if v.dtype == torch.uint8 else None
    if saved is not None and mine.dtype == torch.uint8 and (v.stride() == mine.stride() or v.is_contiguous()
                                                             and mine.is_contiguous()):
        memory_view(mine).copy_(_in_memory_order(v))
        seg.scale_view(key, i, scales).copy_(saved)
        return
    values = _codes_values(key, e) if v.dtype == torch.uint8 else v
    seg.set_moment(key, i, values.reshape(p.shape), states, scales)


def import_state_dict(opt, state_dict: dict) -> None:
    """``opt.load_state_dict(sd)`` from ours or from torch.optim's matching optimizer."""
    saved_state, sid_of, new_groups = checked_groups(opt, state_dict)  # everything checked before any change
    plans = [(seg, [checked_entry(opt, saved_state, sid_of[id(p)], p, opt.param_groups[seg.group_index])
                    for p in seg.params])
             for seg in opt._segs.segments]

    # Build the new buffers aside; swap them in only once all of them are complete.
    built, relaid = [], {}
    with torch.no_grad():
        for seg, entries in plans:
            # a segment without a state the checkpoint holds (SGD's momentum, before a step had momentum): one
            # laid out for it, carrying the rest, takes its place
            names = tuple(dict.fromkeys([*seg.states, *(k for e in entries if e is not None for k in e[1])]))
            if len(names) > len(seg.states):
                relaid[id(seg)] = seg = build_segment(seg.group_index, seg.params, opt._use_master(seg.dtype), names,
                                                      {id(p): (seg, i) for i, p in enumerate(seg.params)},
                                                      seg.precision)
            states = {name: torch.zeros_like(flat) for name, flat in seg.states.items()}
            scales = torch.zeros_like(seg.scales) if getattr(seg, "scales", None) is not None else None
            master = torch.zeros_like(seg.master) if seg.master is not None else None
            steps = [0.0] * len(seg.params)
            for i, (p, entry) in enumerate(zip(seg.tensors(), entries)):
                if entry is not None:
                    e, keys, steps[i] = entry
                    for key in keys:
                        _load_moment(seg, i, key, e, p, states, scales)
                if master is not None and master.dtype == torch.int16:  # remainders (docs/state-precision.md)
                    e = entry[0] if entry is not None else {}
                    mine = seg.view(master, i)
                    if e.get("master_remainder") is not None:
                        mine.copy_(local(e["master_remainder"]).reshape(p.shape))
                    elif e.get("master_param") is not None:
                        mine.copy_(remainders_from(local(e["master_param"]).reshape(p.shape), p.detach()))
                elif master is not None:
                    src = entry[0].get("master_param") if entry is not None else None
                    seg.view(master, i).copy_(local(src).reshape(p.shape) if src is not None else p.detach())
            built.append((seg, states, scales, master, torch.tensor(steps, dtype=torch.float32).to(seg.device),
                          [entry is not None for entry in entries]))
    opt._segs.segments = [relaid.get(id(seg), seg) for seg in opt._segs.segments]
    for seg, states, scales, master, steps, has_state in built:
        if scales is not None:
            seg.scales = scales
        swap_loaded(opt, seg, states, master, steps, has_state)
    finish_load(opt, state_dict, saved_state, new_groups)


def swap_loaded(opt, seg, states: dict, master, steps, has_state) -> None:
    """A segment's loaded buffers in place of its own (built aside, all checked): the next step compares every
    parameter with its loaded master."""
    seg.states, seg.master, seg.steps, seg.has_state = states, master, steps, has_state
    seg.all_state = False
    seg.lr_value = None
    seg.forget()
    seg.keep_remainders = True  # (remainders: loaded with the weights they complete)
    for i, p in enumerate(seg.params):
        if not has_state[i]:
            opt.state.pop(p, None)


def finish_load(opt, state_dict: dict, saved_state: dict, new_groups: list) -> None:
    """After the segments took their loaded buffers: the loaded param groups, and the state that is not a
    parameter's, as torch.optim keeps them; the views in ``opt.state`` bound anew."""
    for g, ng in zip(opt.param_groups, new_groups):
        g.update(ng)
    # what is not a parameter's state replaces what was, as torch.optim keeps it
    saved_ids = {sid for s in state_dict["param_groups"] for sid in s["params"]}
    for k in [k for k in opt.state if not isinstance(k, Tensor)]:
        del opt.state[k]
    for k, v in saved_state.items():
        if k not in saved_ids:
            opt.state[k] = v
    opt._clip_state.forget_partials()
    opt._segs.bind_state(opt)


def torch_state_dict(state_dict: dict) -> dict:
    """``state_dict`` (a fused optimizer's, any state precision) for ``torch.optim``'s optimizers: 8-bit moments'
    codes (``<name>_codes``) decoded exactly to fp32 values under ``<name>``
    (:func:`ampfused.ops.state_precision.q8_dequantize`), their ``<name>_scale`` (or FSDP2's ``<name>_exponent``)
    keys dropped. Everything else is kept as it is (the same tensors): torch casts
    bf16 moments to each parameter's dtype on load, and carries ``master_param`` / ``master_remainder`` along
    without using them."""
    state = {}
    for k, entry in state_dict["state"].items():
        if isinstance(entry, dict):
            entry = _codes_as_moments(entry, [key[:-len(CODES)] for key in entry if key.endswith(CODES)],
                                      f"parameter {k}")
            coded = [key for key, v in entry.items() if isinstance(v, Tensor) and v.dtype == torch.uint8
                     and any(isinstance(entry.get(f"{key}{s}"), Tensor) for s in ("_scale", "_exponent"))]
            decoded = {key: _codes_values(key, entry) for key in coded}
            drop = {f"{key}{s}" for key in coded for s in ("_scale", "_exponent")}
            entry = {key: decoded.get(key, v) for key, v in entry.items() if key not in drop}
        state[k] = entry
    out = dict(state_dict)
    out["state"] = state
    return out
