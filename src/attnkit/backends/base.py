"""The contract between ``attention()`` and its backends.

``attention()`` validates and normalises every call into one :class:`Problem` with a single
layout, then asks the registry for a backend. A backend declares what it supports through
``not_supported_reasons(problem)`` (empty list = can run) and computes ``forward(problem)``.

Shape legend (the one layout every backend sees)::

    q     (B, H_q,  N_q, D_k)      B = all leading dims of the user's inputs, flattened
    k     (B, H_kv, N_k, D_k)      H_q = G · H_kv (G = group size; GQA/MQA when G > 1)
    v     (B, H_kv, N_k, D_v)
    out   (B, H_q,  N_q, D_v)      same dtype as q
    lse   (B, H_q,  N_q)           float32 (float64 for float64 inputs); -inf for empty rows
    bias  broadcastable to (B, H_q, N_q, N_k), finite values only (−∞ entries became mask)

Backends receive N_q ≥ 1 and N_k ≥ 1 (empty sizes are answered by ``attention()``), and
K/V rows that hold NaN/inf have already been replaced by zeros where that matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import Mask
from ..scores import ScoreMod

__all__ = ["Problem", "Backend", "Capabilities", "compute_dtype", "softmax_shift", "finish",
           "merge_partials", "refuse_double_backward"]


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
    in every part (all ``lse_r = −∞``) gets output 0 and LSE −∞. With ``inplace`` the first
    part's output buffer is overwritten (no new ``(…, rows, D)`` tensor).
    """
    if len(parts) == 1:
        return parts[0]
    lse = torch.stack([p[1] for p in parts])                 # (R, …, rows)
    m = softmax_shift(lse.amax(0))                           # (…, rows)
    w = torch.exp(lse - m)                                   # (R, …, rows) 0 where lse = −∞
    s = w.sum(0)                                             # (…, rows)
    empty = s == 0
    s_safe = torch.where(empty, torch.ones_like(s), s)
    w = (w / s_safe).unsqueeze(-1)                           # (R, …, rows, 1) normalised
    out = parts[0][0].mul_(w[0]) if inplace else parts[0][0] * w[0]
    for r in range(1, len(parts)):
        out = out.addcmul_(parts[r][0], w[r]) if inplace else out + parts[r][0] * w[r]
    lse_out = torch.where(empty, torch.full_like(s, -torch.inf), m + torch.log(s_safe))
    return out, lse_out


def refuse_double_backward(backend: str) -> None:
    """Call at the top of a hand-written ``backward``: second derivatives (``create_graph=True``,
    gradgradcheck, Hessian-vector products) through it would be silently wrong, so they are
    refused with one attnkit error, the same on every backend."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"backend {backend!r} computes first derivatives only: second derivatives "
            "(backward with create_graph=True, torch.autograd.gradgradcheck, Hessian-vector "
            "products) are not supported through it. Use backend='reference', whose "
            "derivatives are torch autograd's to any order."
        )


@dataclass
class Problem:
    """One normalised attention call (see the module's shape legend)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Mask | None = None
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    score_mod: ScoreMod | None = None
    dropout_p: float = 0.0

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
        """Query heads per K/V head (1 = MHA, H_q = MQA)."""
        return self.q.shape[1] // self.k.shape[1]

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
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (self.q, self.k, self.v, self.bias))

    def allowed_dense(self) -> torch.Tensor | None:
        """The mask as bool ``(B|1, H_q|1, N_q, N_k)``, or ``None`` when everything is allowed."""
        if self.mask is None:
            return None
        return self.mask.evaluate(self.n_q, self.n_k, batch=self.batch, heads=self.heads_q,
                                  device=self.device)


_ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, as data. :meth:`Backend.not_supported_reasons` turns every
    unmet field into one reason; a backend adds only the checks that no field expresses.

    ``devices``: device types (``"cpu"``, ``"cuda"``); ``dtypes``: input dtypes;
    ``max_head_dim``: the largest ``max(D_k, D_v)`` (None = any); ``max_queries``: the
    largest ``N_q`` (None = any); ``grad``: backward; ``dropout``; ``score_mod``: an
    arbitrary Python score function; ``mask_kinds``: which masks run (``"any"``, or a tuple
    of spec kinds such as ``("band", "lengths", "documents", "small_dense")``, checked by
    the backend itself).
    """

    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] = _ALL_DTYPES
    max_head_dim: int | None = None
    max_queries: int | None = None
    grad: bool = True
    dropout: bool = True
    score_mod: bool = True
    mask_kinds: str | tuple[str, ...] = "any"
    # how to fix an unmet field, appended to its reason (e.g. "use 'tiled' for training")
    hints: tuple[tuple[str, str], ...] = ()

    def reasons(self, p: Problem) -> list[str]:
        """One reason per unmet field (empty = every declared capability fits ``p``)."""
        hint = dict(self.hints)

        def say(field_: str, text: str) -> str:
            return f"{text}: {hint[field_]}" if field_ in hint else text

        out = []
        if p.device.type not in self.devices:
            out.append(say("devices", f"runs on {' / '.join(self.devices)} only "
                                      f"(inputs are on {p.device})"))
        if p.dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            out.append(say("dtypes", f"dtype {p.dtype} is not supported (use {names})"))
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

    def extra_reasons(self, p: Problem) -> list[str]:
        """Backend-specific reasons beyond :attr:`capabilities` (default: none)."""
        return []

    def forward(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(out, lse)`` with shapes ``(B, H_q, N_q, D_v)`` and ``(B, H_q, N_q)``."""
        raise NotImplementedError
