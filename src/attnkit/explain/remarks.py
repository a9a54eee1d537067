"""The teaching remarks: short sentences that the numbers of one trace support.

Each remark kind is looked for in every row of every head at once (NumPy, no Python loop
over rows), so a trace of any size costs O(H·N_q·N_k) array work, and only the remarks that
are shown are formatted.

======================  ===============================================================
kind                    when
======================  ===============================================================
``r_empty_row``         a query may see no key (weights 0, output 0)
``r_masked_max``        the key with the largest raw score is masked
``r_zero_score``        a zero score still gets weight (shown once)
``r_saturated``         one key takes more than 0.99 of a row's weight
``r_symmetric``         S = Sᵀ (Q and K from one shared W)
``r_cross``             n_q ≠ n_k (cross-attention)
``r_concat``            several heads, concatenated
======================  ===============================================================

Shape legend::

    S, W, L, allowed (…, N_q, N_k) → flat (H, N_q, N_k): H = every head of every batch

Caution
-------
- Each kind appears at most ``limit`` times (then "and N more"); remarks are ordered by
  where their kind first appears (head by head, row by row).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .common import axis_labels, default_scale, fmt, head_label, n_matrices
from .strings import check_lang, ko_label


def _ratio(x: float) -> str:
    """How many times smaller the usual scale is: ``10`` (not 10.0) when it is whole."""
    return str(round(x)) if abs(x - round(x)) < 1e-9 * max(1.0, abs(x)) else fmt(x, 1)

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["remarks"]

_ROW_KINDS = ("empty", "masked", "zero", "saturated")      # per-row order of the checks


def remarks(trace: Trace, lang: str = "en", decimals: int = 3, limit: int = 2) -> list[str]:
    """Short teaching remarks the numbers of this trace support (in ``lang``).

    Each kind of remark appears at most ``limit`` times (then "and N more"); the zero-score
    remark once.
    """
    t = check_lang(lang)
    S = trace.scores
    n_q, n_k = S.shape[-2:]
    lead = S.shape[:-2]
    n_h = n_matrices(S)
    many = n_h > 1
    s = S.reshape(n_h, n_q, n_k)                                           # (H, N_q, N_k)
    w = trace.weights.reshape(n_h, n_q, n_k)
    lg = trace.logits.reshape(n_h, n_q, n_k)
    al = np.broadcast_to(trace.allowed, S.shape).reshape(n_h, n_q, n_k)
    ql = axis_labels(trace.q_labels, n_q, "q")
    kl = axis_labels(trace.k_labels, n_k, "k")

    q_words = not (trace.q_labels is None or isinstance(trace.q_labels, str))
    k_words = not (trace.k_labels is None or isinstance(trace.k_labels, str))

    def q_name(h: int, i: int) -> str:
        return (f"[{head_label(lead, h, lang)}] " if many else "") + ql[i]

    def q_noun(h: int, i: int) -> str:
        """The query as the subject of a remark (Korean: "Query 'like'", quoted words)."""
        if lang != "ko":
            return q_name(h, i)
        return ((f"[{head_label(lead, h, lang)}] " if many else "") + "Query "
                + ko_label(ql[i], q_words, lang))

    def k_noun(j: int) -> str:
        return ko_label(kl[j], k_words, lang)

    # (sort key, text maker) per occurrence; the key orders kinds by their first occurrence
    found: dict[str, list[tuple[tuple[int, int, int], int, int]]] = {}
    if n_q and n_k:
        sees = al.any(-1)                                                  # (H, N_q)
        n_seen = al.sum(-1)
        j_max = s.argmax(-1)                                               # (H, N_q)
        s_max = np.take_along_axis(s, j_max[..., None], -1)[..., 0]
        al_max = np.take_along_axis(al, j_max[..., None], -1)[..., 0]
        best_allowed = np.where(al, s, -np.inf).max(-1)
        zeros = al & (np.abs(s) < 1e-12) & (w > 0.01)                      # (H, N_q, N_k)
        rows = {
            "empty": ~sees,
            "masked": sees & ~al_max & (s_max > best_allowed),
            "zero": sees & (n_seen >= 2) & zeros.any(-1),
            "saturated": sees & (n_seen >= 2) & (w.max(-1) > 0.99),
        }
        for rank, kind in enumerate(_ROW_KINDS):
            hs, iis = np.nonzero(rows[kind])
            if hs.size:
                found[kind] = [((int(h), int(i), rank), int(h), int(i)) for h, i in
                               zip(hs[:limit + 1], iis[:limit + 1], strict=True)]
                found[kind].append(((-1, -1, -1), int(hs.size), 0))       # the count
    if n_q == n_k >= 2:
        sym = (np.isclose(s, s.swapaxes(-1, -2), atol=1e-9).all((-2, -1))
               & ~np.isclose(s, s[:, :1, :1]).all((-2, -1)))               # (H,)
        hs = np.flatnonzero(sym)
        if hs.size:
            found["symmetric"] = [((int(h), n_q, 0), int(h), 0) for h in hs[:limit + 1]]
            found["symmetric"].append(((-1, -1, -1), int(hs.size), 0))

    def text(kind: str, h: int, i: int) -> str:
        if kind == "empty":
            return t["r_empty_row"].format(qn=q_noun(h, i))
        if kind == "masked":
            j = int(s[h, i].argmax())
            return t["r_masked_max"].format(qn=q_noun(h, i), kn=k_noun(j),
                                            s=fmt(float(s[h, i, j]), decimals))
        if kind == "zero":
            j = int(np.flatnonzero(zeros[h, i])[0])
            return t["r_zero_score"].format(q=q_name(h, i) if many else ql[i], k=kl[j],
                                            kn=k_noun(j), w=fmt(float(w[h, i, j]), decimals))
        if kind == "saturated":
            fin = lg[h, i][al[h, i]]
            out = t["r_saturated"].format(qn=q_noun(h, i), w=fmt(float(w[h, i].max()), decimals),
                                          spread=fmt(float(fin.max() - fin.min()), 1))
            default = default_scale(trace)
            if trace.scale > default * 1.5 and trace.softcap is None:
                out += t["r_saturated_scale"].format(
                    scale=fmt(trace.scale, decimals), default=fmt(default, decimals),
                    ratio=_ratio(trace.scale / default))
            return out
        pre = f"[{head_label(lead, h, lang)}] " if many else ""          # symmetric
        return pre + t["r_symmetric"].format(q1=ql[0], k2=kl[1], q2=ql[1], k1=kl[0])

    out: list[str] = []
    for kind in sorted(found, key=lambda k: found[k][0][0]):
        *items, (_, count, _) = found[kind]
        keep = 1 if kind == "zero" else limit
        out.extend(text(kind, h, i) for _, h, i in items[:keep])
        if count > keep:
            out.append("    " + t["and_more"].format(n=count - keep))
    if n_q != n_k and n_q > 1 and n_k > 1:
        out.append(t["r_cross"].format(nq=n_q, nk=n_k))
    if trace.output.ndim == 3 and trace.output.shape[0] > 1:
        h, _, dv = trace.output.shape
        out.append(t["r_concat"].format(h=h, dk=trace.q.shape[-1], nq=n_q, dv=dv, hdv=h * dv))
    return out
