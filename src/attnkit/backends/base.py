"""The contract between ``attention()`` and its backends.

``attention()`` validates and normalises every call into one :class:`Problem` with a single
layout, then asks the registry for a backend. A backend declares what it supports through
``not_supported_reasons(problem)`` (empty list = can run) and computes ``forward(problem)``.

Shape legend (the one layout every backend sees)::

    q     (B, H_q,  N_q, D_k)      B = all leading dims of the user's inputs, flattened
    k     (B, H_kv, N_k, D_k)      H_q = G · H_kv (G = group size; GQA/MQA when G > 1)
    v     (B, H_kv, N_k, D_v)
    out   (B, H_q,  N_q, D_v)      same dtype as q
    lse   (B, H_q,  N_q)           float32 (float64 for float64 inputs); −∞ for a row with
                                   no allowed key, NaN for a row whose used inputs hold NaN
    bias  broadcastable to (B, H_q, N_q, N_k), finite values only (−∞ entries became mask)

Backends receive N_q ≥ 1 and N_k ≥ 1 (empty sizes are answered by ``attention()``). K and V
may hold NaN/inf, also in rows that the mask blocks: a backend must not let a blocked entry
reach a row through the softmax (blocked logits are −∞ by ``torch.where``, never by
arithmetic), but it may let ``0 · NaN`` reach the P·V product — ``attention()`` screens the
output and reruns the call with such K/V rows zeroed (see :mod:`attnkit.api`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..masks import NO_MASK, Mask, MaskParts, decompose
from ..scores import NO_SCORE_TERMS, ScoreMod, ScoreTerms, score_terms

__all__ = ["Problem", "Lowered", "Backend", "Capabilities", "compute_dtype", "softmax_shift",
           "finish", "merge_partials", "merge_stacked", "refuse_double_backward"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------ shared primitives
# Every engine ends an online softmax the same way and merges partial results over disjoint
# key sets the same way; these three functions are that one way. Conventions: a row with no
# allowed key has sum 0 and LSE −∞ (→ output 0); NaN anywhere in a row propagates (a NaN
# input that is used shows as NaN, it is never mistaken for "no key").


def softmax_shift(row_max: torch.Tensor) -> torch.Tensor:
    """The row max as the softmax shift: −∞ (a row with no allowed key) becomes 0, so that
    ``exp(x − shift)`` is exactly 0 there instead of NaN. NaN stays NaN."""
    return torch.where(row_max == -torch.inf, torch.zeros_like(row_max), row_max)


def finish(acc: torch.Tensor, row_sum: torch.Tensor, row_max: torch.Tensor,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """End an online softmax: ``out = acc / l`` and ``lse = m + log l``.

    ``acc (…, rows, D)`` is ``Σ_j e^{x_j − m} v_j``, ``row_sum (…, rows)`` is
    ``l = Σ_j e^{x_j − m}`` and ``row_max (…, rows)`` the shift ``m`` that was used.
    A row with ``l == 0`` (no allowed key) gets output 0 and LSE −∞, with zero gradients.
    """
    empty = row_sum == 0
    l_safe = torch.where(empty, torch.ones_like(row_sum), row_sum)
    out = acc / l_safe.unsqueeze(-1)
    lse = torch.where(empty, torch.full_like(row_sum, -torch.inf), row_max + torch.log(l_safe))
    return out, lse


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]], *, inplace: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge normalised partial results of the same rows over disjoint key sets.

    Each part is ``(out_r (…, rows, D), lse_r (…, rows))``; the result is
    ``lse = log Σ_r e^{lse_r}`` and ``out = Σ_r e^{lse_r − lse} out_r``. A row that is empty
    in every part (all ``lse_r = −∞``) gets output 0 and LSE −∞ (an empty part's output must
    be 0 there, as :func:`finish` makes it); NaN in any part's LSE makes the row NaN. With
    ``inplace`` the first part's output buffer is overwritten (no new ``(…, rows, D)``
    tensor).
    """
    if len(parts) == 1:
        return parts[0]
    w, lse_out = _merge_weights(torch.stack([p[1] for p in parts]))   # (R, …, rows, 1)
    out = parts[0][0].mul_(w[0]) if inplace else parts[0][0] * w[0]
    for r in range(1, len(parts)):
        out = out.addcmul_(parts[r][0], w[r]) if inplace else out + parts[r][0] * w[r]
    return out, lse_out


def merge_stacked(out: torch.Tensor, lse: torch.Tensor, dim: int,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_partials` for parts stacked along ``dim``: ``out (…, R, …, rows, D)`` and
    ``lse (…, R, …, rows)`` with the parts at ``dim`` of ``lse`` (a non-negative index) —
    one tensor op per step instead of one per part (flash-decoding's many key chunks)."""
    lse_r = lse.movedim(dim, 0)                                       # (R, …, rows)
    w, lse_out = _merge_weights(lse_r)                                # (R, …, rows, 1)
    out_r = out.movedim(dim, 0)                                       # (R, …, rows, D)
    return (out_r * w).sum(0), lse_out


def _merge_weights(lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one LSE merge: parts' LSEs ``(R, …, rows)`` → normalised weights
    ``(R, …, rows, 1)`` (exactly 0 for a part with LSE −∞) and the merged LSE ``(…, rows)``."""
    m = softmax_shift(lse.amax(0))                           # (…, rows) NaN stays NaN
    w = torch.exp(lse - m)                                   # (R, …, rows) 0 where lse = −∞
    s = w.sum(0)                                             # (…, rows)
    empty = s == 0
    s_safe = torch.where(empty, torch.ones_like(s), s)
    w = (w / s_safe).unsqueeze(-1)
    lse_out = torch.where(empty, torch.full_like(s, -torch.inf), m + torch.log(s_safe))
    return w, lse_out


def refuse_double_backward(backend: str, *, what: str = "backend", fix: str | None = None,
                           ) -> None:
    """Call at the top of a hand-written ``backward``: second derivatives (``create_graph=True``,
    gradgradcheck, Hessian-vector products) through it would be silently wrong, so they are
    refused with one attnkit error, the same on every backend. ``what`` and ``fix`` adapt the
    message for callers that are not backends (e.g. ring attention)."""
    if torch.is_grad_enabled():
        fix = fix or ("Use backend='reference', whose derivatives are torch autograd's to any "
                      "order.")
        raise NotImplementedError(
            f"{what} {backend!r} computes first derivatives only: second derivatives "
            "(backward with create_graph=True, torch.autograd.gradgradcheck, Hessian-vector "
            f"products) are not supported through it. {fix}"
        )


class Lowered(NamedTuple):
    """A :class:`Problem` lowered once for every engine: its mask as closed-form parts and
    a rest (:func:`attnkit.masks.decompose`, the one decomposition) and its score mod as
    data (:func:`attnkit.scores.score_terms`: ALiBi, a relative-bias table, or a Python
    function). Scale, soft-cap and bias are the Problem's own fields. Engines read this
    instead of taking the mask or the score mod apart themselves."""

    mask: MaskParts
    terms: ScoreTerms


_NOTHING_TO_LOWER = Lowered(NO_MASK, NO_SCORE_TERMS)


@dataclass
class Problem:
    """One normalised attention call (see the module's shape legend).

    :attr:`lowered` is computed on first use and kept: a Problem is not changed once an
    engine has read it (make a new one with ``dataclasses.replace``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Mask | None = None
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    score_mod: ScoreMod | None = None
    dropout_p: float = 0.0
    #: The bool tensor the call gave as its mask, in this layout's frame
    #: ``(B|1, H_q|1, N_q|1, N_k|1)`` (True = may attend), when ``mask`` is exactly that
    #: tensor's Mask (``attention()`` sets both): an engine that needs the mask densely may
    #: read it instead of evaluating ``mask`` — the same values, without a copy. None otherwise.
    mask_tensor: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # where a mask first meets the call's sizes: refused here for every backend alike
        # (also for engines that read its closed-form parts instead of evaluating it)
        if self.mask is not None:
            self.mask.check(self.q.shape[2], self.k.shape[2])

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads_q(self) -> int:
        return self.q.shape[1]

    @property
    def heads_kv(self) -> int:
        return self.k.shape[1]

    @property
    def group(self) -> int:
        """Query heads per K/V head (1 = MHA, H_q = MQA; 1 when there are no heads at all)."""
        return self.q.shape[1] // self.k.shape[1] if self.k.shape[1] else 1

    @property
    def n_q(self) -> int:
        return self.q.shape[2]

    @property
    def n_k(self) -> int:
        return self.k.shape[2]

    @property
    def d_k(self) -> int:
        return self.q.shape[3]

    @property
    def d_v(self) -> int:
        return self.v.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def lowered(self) -> Lowered:
        """The call lowered for the engines (see :class:`Lowered`), once per Problem (kept
        in the instance's ``__dict__``, not a field: ``dataclasses.replace`` lowers anew)."""
        low = self.__dict__.get("_lowered")
        if low is None:
            if self.mask is None and self.score_mod is None:
                low = _NOTHING_TO_LOWER
            else:
                low = Lowered(decompose(self.mask, self.q.shape[2], self.k.shape[2]),
                              score_terms(self.score_mod, self.q.shape[1]))
            self.__dict__["_lowered"] = low
        return low

    def lowered_as(self, low: Lowered) -> Problem:
        """Give :attr:`lowered` as ``low``, already known: what a Problem with the same mask
        object, score mod and sizes lowered to (the eager path's per-signature frames keep it,
        so that a decoder's repeated call does not decompose its mask again) → ``self``."""
        self.__dict__["_lowered"] = low
        return self

    def dense_mask_elements(self) -> int:
        """Elements of the dense form of the mask's rest (0 when all of it is closed-form):
        what an engine that reads the rest densely would evaluate."""
        return self.lowered.mask.rest_elements(self.batch, self.heads_q, self.n_q, self.n_k)

    @property
    def requires_grad(self) -> bool:
        if not torch.is_grad_enabled():
            return False
        b = self.bias
        return (self.q.requires_grad or self.k.requires_grad or self.v.requires_grad
                or (b is not None and b.requires_grad))

    def describe(self) -> str:
        """The call in one line, for errors: shapes, dtype, device, mask and options."""
        parts = [f"q {tuple(self.q.shape)}, k {tuple(self.k.shape)}, v {tuple(self.v.shape)} "
                 "(B, H, N, D)", _dtype_name(self.dtype), f"on {self.device}",
                 f"mask {self.mask.name}" if self.mask is not None else "no mask"]
        if self.bias is not None:
            parts.append(f"float mask/bias {tuple(self.bias.shape)}")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap}")
        if self.score_mod is not None:
            parts.append(f"score_mod {getattr(self.score_mod, '__name__', 'fn')}")
        if self.dropout_p > 0.0:
            parts.append(f"dropout_p={self.dropout_p}")
        if self.requires_grad:
            parts.append("needs gradients")
        return ", ".join(parts)

    def allowed_dense(self) -> torch.Tensor | None:
        """The mask as bool ``(B|1, H_q|1, N_q, N_k)``, or ``None`` when everything is allowed."""
        if self.mask is None:
            return None
        return self.mask.evaluate(self.n_q, self.n_k, batch=self.batch, heads=self.heads_q,
                                  device=self.device)


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, as data. :meth:`Backend.not_supported_reasons` turns every
    unmet field into one reason; a backend adds only the checks that no field expresses
    (:meth:`Backend.extra_reasons`).

    ``devices``: device types (``"cpu"``, ``"cuda"``; None = any); ``dtypes``: input dtypes
    (None = any); ``max_head_dim``: the largest ``max(D_k, D_v)`` (None = any);
    ``max_queries``: the largest ``N_q`` (None = any); ``grad``: backward; ``dropout``;
    ``score_mod``: an arbitrary Python score function; ``hints``: ``(field, how to fix
    it)`` pairs, each appended to that field's reason (e.g. ``("grad", "use 'tiled' for
    training")``). Which masks a backend runs is not a field: masks are too varied for a
    list of kinds, so each backend says why it refuses one in ``extra_reasons``.
    """

    devices: tuple[str, ...] | None = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] | None = (torch.float16, torch.bfloat16, torch.float32,
                                              torch.float64)
    max_head_dim: int | None = None
    max_queries: int | None = None
    grad: bool = True
    dropout: bool = True
    score_mod: bool = True
    hints: tuple[tuple[str, str], ...] = ()

    def fits(self, p: Problem) -> bool:
        """``not self.reasons(p)``, without building the reasons' text (what
        ``backend="auto"`` asks of every backend on every call)."""
        q = p.q
        if self.devices is not None and q.device.type not in self.devices:
            return False
        if self.dtypes is not None and q.dtype not in self.dtypes:
            return False
        if self.max_head_dim is not None and max(q.shape[3], p.v.shape[3]) > self.max_head_dim:
            return False
        if self.max_queries is not None and q.shape[2] > self.max_queries:
            return False
        if not self.grad and p.requires_grad:
            return False
        if not self.dropout and p.dropout_p > 0.0:
            return False
        return self.score_mod or p.score_mod is None

    def reasons(self, p: Problem) -> list[str]:
        """One reason per unmet field (empty = every declared capability fits ``p``)."""
        def say(field_: str, text: str) -> str:
            hint = dict(self.hints)
            return f"{text}: {hint[field_]}" if field_ in hint else text

        out = []
        if self.devices is not None and p.device.type not in self.devices:
            where = " / ".join(d.upper() if d in ("cpu", "cuda") else d for d in self.devices)
            out.append(say("devices", f"runs on {where} only (inputs are on {p.device})"))
        if self.dtypes is not None and p.dtype not in self.dtypes:
            names = ", ".join(_dtype_name(d) for d in self.dtypes)
            out.append(say("dtypes", f"dtype {_dtype_name(p.dtype)} is not supported "
                                     f"(supported: {names})"))
        if self.max_head_dim is not None and max(p.d_k, p.d_v) > self.max_head_dim:
            out.append(say("max_head_dim", f"head dims D_k={p.d_k}, D_v={p.d_v} exceed "
                                           f"{self.max_head_dim}"))
        if self.max_queries is not None and p.n_q > self.max_queries:
            out.append(say("max_queries", f"made for at most {self.max_queries} queries, "
                                          f"got N_q={p.n_q}"))
        if not self.grad and p.requires_grad:
            out.append(say("grad", "forward only (inputs require grad)"))
        if not self.dropout and p.dropout_p > 0.0:
            out.append(say("dropout", f"no dropout, got dropout_p={p.dropout_p}"))
        if not self.score_mod and p.score_mod is not None:
            out.append(say("score_mod", "score_mod is an arbitrary Python function that this "
                                        "backend cannot run"))
        return out


class Backend:
    """Base class: a named way to compute attention for the problems it supports.

    A backend declares :attr:`capabilities` (data) and overrides :meth:`extra_reasons` only
    for checks the capabilities cannot express.
    """

    name: str = "?"
    description: str = ""
    capabilities: Capabilities = Capabilities()

    def not_supported_reasons(self, p: Problem) -> list[str]:
        """Why this backend cannot run ``p`` (an empty list means it can)."""
        return self.capabilities.reasons(p) + self.extra_reasons(p)

    def can_run(self, p: Problem) -> bool:
        """``not self.not_supported_reasons(p)``: what ``backend="auto"`` asks of every
        backend in priority order. A backend may answer it faster (without building the
        reasons' text) where the answer is plain — it must always agree with the reasons."""
        caps = self.capabilities
        if ("not_supported_reasons" in getattr(self, "__dict__", ())
                or type(self).not_supported_reasons is not Backend.not_supported_reasons
                or type(caps).reasons is not Capabilities.reasons):
            return not self.not_supported_reasons(p)     # reasons of its own: ask them
        return caps.fits(p) and not self.extra_reasons(p)

    def extra_reasons(self, p: Problem) -> list[str]:
        """Backend-specific reasons beyond :attr:`capabilities` (default: none)."""
        return []

    def forward(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(out, lse)`` with shapes ``(B, H_q, N_q, D_v)`` and ``(B, H_q, N_q)``."""
        raise NotImplementedError

    #: Whether :meth:`forward_screened`'s ``finite`` under a user score_mod also vouches for
    #: the K/V rows read (then the eager path screens K/V after the call, only where it is
    #: False, instead of before it). Opt-in: a backend whose ``finite`` tells of ``out``
    #: alone keeps the K/V screen up front.
    screens_kv: bool = False

    def forward_screened(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """:meth:`forward` → ``(out, lse, finite)``: ``finite`` True when the backend knows
        every element of ``out`` to be finite (it read them as it wrote them), so the caller
        may skip its own pass over ``out`` (the NaN/inf screen) — and, for a backend with
        :attr:`screens_kv` and a call with a user score_mod (``p.lowered.terms.user``), also
        every K and V row it read (its tiles a mask leaves empty aside), so the caller may
        skip its K/V screen; False = not known (the default: the caller screens)."""
        out, lse = self.forward(p)
        return out, lse, False
