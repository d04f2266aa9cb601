"""Reading SASS text (``cuobjdump -sass`` / ``nvdisasm`` output): functions, their loops, and what one trip of a
loop issues.

A function's instructions are ``/*addr*/ [@pred] OPCODE operands ;`` lines. A loop is a backward branch (``BRA``
to a lower address); its body is the address range from the target to the branch. One trip is counted along the
longest path through that body (the instructions issued when every branch inside takes its costlier side): a
loop that holds several variants of its body (a moment present or not, a masked or a full vector) counts the
largest, not their sum. A path that leaves the range is not followed, and a path through a ``CALL`` (an
out-of-line slow path for rare operands: the IEEE division's subroutine, say) is counted only when no other
path goes round the trip (``longest_path``).

Memory: ``LDG``/``STG`` (global) and ``LD``/``ST`` (generic addresses, global here: a pointer read from the tensor
table is not known to be global, so the compiler emits generic accesses for it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSN = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_TARGET = re.compile(r"(?:0x)?([0-9a-fA-F]+)\s*$")
_ARCH = re.compile(r"(?:arch\s*=|code for)\s*(sm_\d+a?)")


@dataclass
class Insn:
    addr: int
    pred: str
    op: str
    args: str


@dataclass
class Function:
    name: str
    arch: str
    insns: List[Insn] = field(default_factory=list)


def parse(text: str) -> List[Function]:
    """Every function of a SASS listing, in order, with the architecture its section names."""
    funcs: List[Function] = []
    arch = ""
    cur: Optional[Function] = None
    for line in text.splitlines():
        m = _ARCH.search(line)
        if m and "Function" not in line:
            arch = m.group(1)
        m = _FUNC.match(line)
        if m:
            cur = Function(m.group(1), arch)
            funcs.append(cur)
            continue
        m = _INSN.match(line)
        if m and cur is not None:
            cur.insns.append(Insn(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return funcs


def mem_width(op: str) -> int:
    """Bytes per thread of a global load or store opcode (``LDG.E.128`` 16, ``STG.E.U8`` 1, ...)."""
    parts = op.split(".")
    for p, w in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if p in parts:
            return w
    return 4


@dataclass
class Trip:
    """What one trip of a loop issues, per thread."""
    start: int
    end: int
    insns: int = 0
    loads: int = 0
    load_bytes: int = 0
    stores: int = 0
    store_bytes: int = 0
    widths: Dict[str, int] = field(default_factory=dict)  # "LDG.128" -> count
    mufu: int = 0
    rsq: int = 0           # MUFU.RSQ: one per square root
    bars: int = 0
    shfl: int = 0
    markers: int = 0       # instructions carrying one of the caller's marker immediates


def _branch_target(insn: Insn) -> Optional[int]:
    if not insn.op.startswith("BRA"):
        return None
    m = _TARGET.search(insn.args.replace("`", "").replace("(", "").replace(")", ""))
    return int(m.group(1), 16) if m else None


def loops(fn: Function) -> List[tuple]:
    """(target, branch address) of every backward branch."""
    out = []
    for insn in fn.insns:
        t = _branch_target(insn)
        if t is not None and t <= insn.addr:
            out.append((t, insn.addr))
    return out


def innermost_loops(fn: Function) -> List[tuple]:
    """The loops whose body holds no other loop."""
    all_loops = loops(fn)
    return [(t, a) for t, a in all_loops
            if not any((t2, a2) != (t, a) and t <= t2 and a2 <= a for t2, a2 in all_loops)]


def trip(fn: Function, start: int, end: int, markers=()) -> Trip:
    """The static counts of the instructions in [start, end]. ``markers``: integers whose appearance as an
    immediate operand (hex, either sign) marks an instruction of interest (a hash's multiplier, say)."""
    pats = []
    for v in markers:
        signed = v - (1 << 32) if v >= 1 << 31 else v
        pats.append(re.compile(r"(?<![0-9a-fA-Fx])-?0x(%x|%x)\b" % (v, abs(signed)), re.I))
    tr = Trip(start, end)
    for insn in longest_path(fn, start, end):
        tr.insns += 1
        head = insn.op.split(".")[0]
        if head in ("LDG", "STG", "LD", "ST"):
            w = mem_width(insn.op)
            key = f"{head}.{w * 8}"
            tr.widths[key] = tr.widths.get(key, 0) + 1
            if head in ("LDG", "LD"):
                tr.loads += 1
                tr.load_bytes += w
            else:
                tr.stores += 1
                tr.store_bytes += w
        elif head == "MUFU":
            tr.mufu += 1
            tr.rsq += insn.op == "MUFU.RSQ"
        elif head == "BAR":
            tr.bars += 1
        elif head == "SHFL":
            tr.shfl += 1
        if any(p.search(insn.args) for p in pats):
            tr.markers += 1
    return tr


def _unconditional(insn: Insn) -> bool:
    """A branch always taken: no guard predicate and no condition operand (``BRA P1, addr``, ``BRA.DIV UR4,
    addr`` are conditional)."""
    return insn.pred in ("", "@PT") and "," not in insn.args


def longest_path(fn: Function, start: int, end: int, avoid_calls: bool = True) -> List[Insn]:
    """The instructions of the longest path from ``start`` to the back-edge branch at ``end`` (NOPs left out):
    fall through to the next instruction unless an unconditional ``BRA``/``EXIT``/``RET`` ends the way; a branch
    into the range adds an edge to its target (forward only: the loop is innermost). With ``avoid_calls``, the
    longest path that calls no out-of-line code, where one exists: in these kernels a ``CALL`` is a slow path
    for rare operands (the IEEE division's and square root's for special values, the general 8-bit encoder for
    a block holding values below its codes' normal range), kept out of line so that the common path is short."""
    if avoid_calls:
        path = _longest(fn, start, end, skip_calls=True)
        if path:
            return path
    return _longest(fn, start, end, skip_calls=False)


def _longest(fn: Function, start: int, end: int, skip_calls: bool) -> List[Insn]:
    body = [i for i in fn.insns if start <= i.addr <= end]
    index = {insn.addr: k for k, insn in enumerate(body)}
    n = len(body)
    best = [-1] * n   # instructions on the longest path from start to here (inclusive), -1 unreachable
    prev = [-1] * n
    if not n:
        return []
    best[0] = 0 if body[0].op == "NOP" else 1
    for k, insn in enumerate(body):
        if best[k] < 0 or k == n - 1 or (skip_calls and insn.op.startswith("CALL")):
            continue
        succ = []
        stop = insn.op.split(".")[0] in ("EXIT", "RET", "BRK") and insn.pred in ("", "@PT")
        target = _branch_target(insn)
        if target is not None:
            if target in index and index[target] > k:
                succ.append(index[target])
            if _unconditional(insn):
                stop = True
        if not stop:
            succ.append(k + 1)
        for j in succ:
            w = best[k] + (0 if body[j].op == "NOP" else 1)
            if w > best[j]:
                best[j], prev[j] = w, k
    if best[n - 1] < 0:
        return []
    path, k = [], n - 1
    while k >= 0:
        if body[k].op != "NOP":
            path.append(body[k])
        k = prev[k]
    return path[::-1]
