"""Tolerances derived from the reference's own error, as the design's contract states.

A fast result passes when its error against an fp64 computation is within 2x the error of the plain fp32
reference against that fp64 computation, plus a small absolute floor (relative to the values' magnitude).
"""
import contextlib

import torch


@contextlib.contextmanager
def no_host_sync(enabled: bool = True):
    """Any host synchronisation inside raises (CUDA's sync debug mode "error"); restored on the way out."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def report_mismatch(name, actual, expected, bad, k=5):
    idx = bad.nonzero().flatten()[:k].tolist()
    rows = [f"  [{i}] got {actual.flatten()[i].item()!r} expected {expected.flatten()[i].item()!r}" for i in idx]
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    return (f"{name}: {int(bad.sum())} of {bad.numel()} elements out of tolerance; first:\n" + "\n".join(rows)
            + f"\n  NaN disagree at {int((nan_a ^ nan_e).sum())} elements,"
            + f" inf disagree at {int((torch.isinf(actual) ^ torch.isinf(expected)).sum())}")


def assert_close_to_oracle(name, fast, ref32, ref64, floor=1e-7):
    """max|fast - ref64| <= 2 * max|ref32 - ref64| + floor * max(1, max|ref64|), NaN/inf placement equal."""
    # compared on the host: the oracle is computed there, the fast result may live on a device
    fast64, ref32_64, ref64 = (t.detach().double().flatten().cpu() for t in (fast, ref32, ref64))
    assert torch.equal(torch.isnan(fast64), torch.isnan(ref64)), report_mismatch(
        name, fast64, ref64, torch.isnan(fast64) ^ torch.isnan(ref64))
    fin = torch.isfinite(ref64)
    assert torch.equal(fast64[~fin].nan_to_num(0), ref64[~fin].nan_to_num(0)), f"{name}: infinities differ"
    if not fin.any():
        return
    err_fast = (fast64 - ref64).abs()[fin]
    err_ref = (ref32_64 - ref64).abs()[fin].max()
    scale = max(1.0, ref64[fin].abs().max().item())
    bound = 2 * err_ref + floor * scale
    bad = torch.zeros_like(fast64, dtype=torch.bool)
    bad[fin] = err_fast > bound
    assert not bad.any(), report_mismatch(name, fast64, ref64, bad) + f"\n  bound {bound.item():.3g}"


def assert_bitwise(name, a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    same = (a.view(torch.uint8) if a.dtype == torch.bool else a).flatten()
    other = (b.view(torch.uint8) if b.dtype == torch.bool else b).flatten()
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        same, other = same.view(bits), other.view(bits)
    bad = same != other
    assert not bad.any(), report_mismatch(name, a.flatten(), b.flatten(), bad)
