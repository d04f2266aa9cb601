"""What a fused step inherits from the calls made on its gradients before it: an unscale, a clip.

``ampfused.GradScaler.unscale_`` and ``ampfused.clip_grad_norm_`` run K1 themselves (the unscale writes the
unscaled gradients back; the clip only measures them) and leave the partials, and the clip its coefficient and
``max_norm``, for the next step, which then neither measures the same gradients again nor clips them in a pass
of its own. :class:`ClipState` is that hand-over; every change to it is one of its methods:

* :meth:`ClipState.unscaled`: gradients unscaled in place, with a coefficient into which a clip made on them
  while they were still scaled was folded (:meth:`ClipState.unscale_coef`);
* :meth:`ClipState.measured` / :meth:`ClipState.clip_folded`: a clip of the gradients as they are;
* :meth:`ClipState.consumed_by_step`: the step takes everything (:class:`Owed`);
* :meth:`ClipState.reset` (``zero_grad``, a step without gradients) and :meth:`ClipState.forget_partials`
  (the segments or the state were rebuilt).

The partials stay valid only while the gradients they measured are the same tensors at the same version
counters: the step and the clip check that before they reuse them.
"""
from __future__ import annotations

import enum
from typing import List, NamedTuple, Optional

import torch
from torch import Tensor

from .. import ops


class Partials(enum.Enum):
    """What the held partials measured (the values are the tags pickles of older optimizers carry)."""

    NONE = None  # nothing held
    AS_THEY_ARE = "as they are"  # a clip measured the gradients as they were (scaled, if a scaler runs)
    UNSCALED = "unscaled"  # an unscale measured them while it unscaled them in place


class Owed(NamedTuple):
    """What one step takes over: ``partials`` to use instead of K1 (gradients unscaled or measured already, and
    the step unscales nothing), ``coef`` to multiply the step's unscale coefficient by (a clip measured on the
    gradients before the step unscales them), ``max_norm`` to fold into K2's clip."""

    partials: Optional[Tensor]
    coef: Optional[Tensor]
    max_norm: Optional[float]


def _same_grads(keys: List[tuple], grads: List[Tensor]) -> bool:
    return len(keys) == len(grads) and all(k[0] is g and k[1] == g._version for k, g in zip(keys, grads))


class ClipState:
    """The unscale and clip made on the gradients since the last step (see the module docstring)."""

    def __init__(self):
        self.held = Partials.NONE
        self.keys: Optional[List[tuple]] = None  # (gradient, version) of each gradient the partials measured
        self.partials: Optional[Tensor] = None
        self.max_norm: Optional[float] = None  # a clip folded into the next step, on its unscaled gradients
        self.coef: Optional[Tensor] = None  # coefficient of a clip made on gradients not unscaled yet

    @classmethod
    def from_fields(cls, cache: Optional[tuple], pending_clip: Optional[float],
                    raw_clip: Optional[Tensor]) -> "ClipState":
        """From the attributes that optimizers pickled before this class existed held: ``(keys, partials,
        tag)`` (or ``None``), the pending ``max_norm`` and the clip coefficient."""
        state = cls()
        if cache is not None:
            state._hold(Partials(cache[2]), cache[0], cache[1])
        state.max_norm = pending_clip
        state.coef = raw_clip
        return state

    @property
    def holds_partials(self) -> bool:
        return self.held is not Partials.NONE

    def holds_partials_of(self, grads: List[Tensor]) -> bool:
        """Whether the held partials measured these gradients, as they are now."""
        return self.held is not Partials.NONE and _same_grads(self.keys, grads)

    def _hold(self, held: Partials, keys: Optional[List[tuple]], partials: Optional[Tensor]) -> None:
        self.held, self.keys, self.partials = held, keys, partials

    # --- transitions --------------------------------------------------------------------------------------
    def unscale_coef(self, inv_scale: Tensor) -> Tensor:
        """The coefficient an unscale about to run multiplies the gradients by: a clip made on them while they
        were scaled acts on them there (torch clips ``max_norm * scale``), and is then done."""
        if self.coef is not None:
            inv_scale = inv_scale * self.coef
            self.coef = None
            self.max_norm = None
        return inv_scale

    def unscaled(self, keys: Optional[List[tuple]], partials: Optional[Tensor]) -> None:
        """The gradients were unscaled in place and measured (``None``: there were none to unscale)."""
        if partials is None:
            self.forget_partials()
        else:
            self._hold(Partials.UNSCALED, keys, partials)

    def measured(self, keys: List[tuple], partials: Tensor) -> None:
        """A clip measured the gradients as they are (no partials of them were held)."""
        self._hold(Partials.AS_THEY_ARE, keys, partials)

    def clip_folded(self, norm: Tensor, max_norm: float) -> None:
        """A clip to ``max_norm`` of the gradients the held partials measured (``norm``: theirs), left to the
        next step."""
        if self.held is not Partials.UNSCALED:
            # The gradients as they are now: if the step later unscales them (a scaler hands it the scale), this
            # clip was made on the scaled gradients and must act on them; the step then multiplies its unscale
            # coefficient by this clip's coefficient, on the device.
            coef = ops.clip_coef(norm, max_norm)
            # a second clip of the same gradients: the smaller coefficient, as clipping twice in place gives
            self.coef = coef if self.coef is None else torch.minimum(self.coef, coef)
        self.max_norm = max_norm if self.max_norm is None else min(self.max_norm, max_norm)

    def consumed_by_step(self, grads: List[Tensor], scaled: bool) -> Owed:
        """Everything held, taken by a step over ``grads`` (``scaled``: the step unscales them itself)."""
        held, coef, max_norm = self.held, self.coef, self.max_norm
        same = held is not Partials.NONE and _same_grads(self.keys, grads)
        partials = self.partials if same and not scaled else None
        # (no attribute set when there is nothing to clear: a compiled step sets none)
        if coef is not None:
            self.coef = None
        if max_norm is not None:
            self.max_norm = None
        if held is not Partials.NONE:
            self.forget_partials()
        if coef is not None:
            if held is Partials.AS_THEY_ARE and same and not scaled:
                coef = None  # the step reads the gradients the clip measured: it folds into K2 (max_norm)
            else:
                # the step unscales them, or they changed since (e.g. unscaled in place by torch's GradScaler):
                # the clip's coefficient, measured on the gradients as they were, joins the unscale coefficient
                max_norm = None
        return Owed(partials, coef, max_norm)

    def forget_partials(self) -> None:
        """The held partials no longer describe what a step would read (segments or state rebuilt)."""
        self._hold(Partials.NONE, None, None)

    def reset(self) -> None:
        """The gradients are gone (``zero_grad``) or there were none: a clip of them is dropped with them."""
        self.forget_partials()
        self.max_norm = None
        self.coef = None
