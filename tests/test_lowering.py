"""One lowering per call: ``masks.decompose`` (the one decomposition of a mask into its
closed-form parts), ``scores.score_terms`` (a score mod as data) and ``Problem.lowered``,
which every engine reads instead of taking the mask or the score mod apart itself."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

import pytest
import torch

import attnkit as ak
from attnkit import masks as M
from attnkit import ops
from attnkit import scores as S
from attnkit.backends import base
from attnkit.backends.base import Problem

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "attnkit"


def _allowed_from_parts(parts: M.MaskParts, n_q: int, n_k: int, batch: int) -> torch.Tensor:
    """The bool mask ``(B, 1|H, N_q, N_k)`` that ``parts`` describe, rebuilt by hand from the
    module's formula (band ∧ lengths ∧ documents ∧ rest)."""
    q = torch.arange(n_q).view(1, 1, -1, 1)
    k = torch.arange(n_k).view(1, 1, 1, -1)
    out = torch.ones(batch, 1, n_q, n_k, dtype=torch.bool)
    if parts.band is not None:
        lo, hi = parts.band
        out = out & (q - k >= lo) & (q - k <= hi)
    if parts.kv_lengths is not None:
        out = out & (k < parts.kv_lengths.view(-1, 1, 1, 1))
        if parts.q_lengths is not None:
            out = out & (q < parts.q_lengths.view(-1, 1, 1, 1))
    if parts.doc_ids is not None:
        out = out & (parts.doc_ids[:, None, :, None] == parts.kv_doc_ids[:, None, None, :])
    if parts.rest is not None:
        out = out & parts.rest.to_dense(n_q, n_k, batch=batch)
    return out


IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]])
CASES = {
    "causal & window": lambda: M.causal() & M.sliding_window(3),
    "bottom-right causal & top-left band": lambda: (M.causal("bottom_right")
                                                    & M.band(-2, 4)),
    "two paddings": lambda: M.padding([3, 6], q_lengths=[7, 4]) & M.padding([5, 2]),
    "padding & documents & causal": lambda: (M.padding([6, 7]) & M.document(IDS)
                                             & M.causal()),
    "two document masks": lambda: M.document(IDS) & M.document(IDS.flip(-1)),
    "prefix_lm & padding": lambda: M.prefix_lm(2) & M.padding([4, 7]),
    "full": M.full,
    "from_fn": lambda: M.from_fn(lambda b, h, q, k: (q + k) % 3 != 0) & M.causal(),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parts_mean_the_mask(name: str) -> None:
    n = 7
    mask = CASES[name]()
    parts = M.decompose(mask, n, n)
    assert torch.equal(_allowed_from_parts(parts, n, n, 2).expand(2, 1, n, n),
                       mask.to_dense(n, n, batch=2).expand(2, 1, n, n))


def test_the_rules_bands_intersect_with_their_alignment_folded_in() -> None:
    parts = M.decompose(M.causal("bottom_right") & M.sliding_window(4), 3, 8)
    # bottom-right causal on 3×8: q − k >= −5; the window: 0 <= q − k <= 3
    assert parts.band == (0, 3) and len(parts.bands) == 2 and parts.only_bands
    assert parts.as_band() == (0, 3)
    assert M.decompose(M.full(), 4, 4).band is None
    assert M.decompose(M.full(), 4, 4).as_band() == (-math.inf, math.inf)
    assert M.decompose(M.padding([2]), 4, 4).as_band() is None


def test_the_rules_paddings_take_the_minimum_and_a_second_document_is_the_rest() -> None:
    parts = M.decompose(M.padding([3, 6], q_lengths=[7, 4]) & M.padding([5, 2]), 7, 7)
    assert parts.kv_lengths.tolist() == [3, 2] and parts.q_lengths.tolist() == [7, 4]
    assert parts.rest is None
    first, second = M.document(IDS), M.document(IDS.flip(-1))
    parts = M.decompose(first & second, 7, 7)
    assert parts.documents is first and parts.rest is second
    assert M.decompose(M.document(IDS), 5, 5).rest is not None       # ids for another size


def test_a_single_term_without_closed_form_is_the_rest_itself() -> None:
    m = M.from_tensor(torch.rand(4, 4) > 0.5)
    assert M.decompose(m, 4, 4).rest is m
    assert M.decompose(None, 4, 4).rest is None


def test_score_terms_read_the_spec_that_fits_and_call_anything_else() -> None:
    ali = S.alibi(4)
    t = S.score_terms(ali, heads=4)
    assert t.alibi is ali.spec and t.relative is None and t.user is None
    assert S.score_terms(ali, heads=8).user is ali             # one slope per head, or called
    table = torch.randn(4, 5)
    t = S.score_terms(S.relative_bias(table, 2), heads=4)
    assert t.relative is not None and t.relative.table is table
    t = S.score_terms(S.checked_score_mod(ali, batch=1, heads=4, n_q=3, n_k=3,
                                          dtype=torch.float32, device=torch.device("cpu")),
                      heads=4)
    assert t.alibi is ali.spec and t.fn is ali                  # through api's checker

    def bump(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + 1.0

    t = S.score_terms(bump, heads=4)
    assert t.user is bump and t.alibi is None and t.relative is None
    assert S.score_terms(None, heads=4).user is None


def _problem(mask: M.Mask | None = None, score_mod: object = None) -> Problem:
    q = torch.randn(2, 4, 7, 8)
    kv = torch.randn(2, 2, 7, 8)
    return Problem(q, kv, kv.clone(), mask=mask, score_mod=score_mod)  # type: ignore[arg-type]


def test_a_problem_is_lowered_once_and_a_replaced_problem_again() -> None:
    p = _problem(M.causal() & M.padding([3, 5]))
    low = p.lowered
    assert p.lowered is low and low.mask.band == (0, math.inf)
    assert low.mask.kv_lengths.tolist() == [3, 5]
    p2 = dataclasses.replace(p, mask=M.causal())
    assert p2.lowered is not low and p2.lowered.mask.kv_lengths is None
    assert p.dense_mask_elements() == 0
    assert _problem(M.prefix_lm(2)).dense_mask_elements() == 7 * 7


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_each_call_lowers_its_mask_once(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines read ``Problem.lowered``: the decomposition runs once per call, whoever asks
    (the native kernel's ``supports`` and forward, the tiled planner, …)."""
    if native and not ak.backends.native.available():
        pytest.skip(f"native kernel unavailable: {ak.backends.native.why_unavailable()}")
    monkeypatch.setenv("ATTNKIT_NATIVE", "1" if native else "0")
    calls = []
    real = base.decompose

    def counting(*a: object) -> M.MaskParts:
        calls.append(a)
        return real(*a)  # type: ignore[arg-type]

    q, k, v = torch.randn(2, 4, 33, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    mask = M.causal("bottom_right") & M.padding([30, 40])
    ref = ak.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    monkeypatch.setattr(base, "decompose", counting)
    out = ak.attention(q, k, v, mask=mask, backend="tiled")
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert len(calls) == 1


@pytest.mark.parametrize("backend", ["reference", "tiled", "triton"])
def test_two_paddings_mean_the_same_on_every_engine(backend: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for n in (6, 9, 9))
    mask = M.padding([7, 9], q_lengths=[6, 3]) & M.padding([5, 9]) & M.causal("bottom_right")
    dense = mask.to_dense(6, 9, batch=2)
    want = ak.attention(q, k, v, mask=dense, backend="reference")
    got = ak.attention(q, k, v, mask=mask, backend=backend)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


def test_the_operator_carries_two_paddings_as_one() -> None:
    mask = M.padding([3, 6]) & M.padding([5, 2]) & M.causal()
    a = ops.op_args(mask, 6, 6)
    assert not isinstance(a, str) and a.kv_lengths.tolist() == [3, 2]
    back = ops.rebuild_mask(a.bands, a.kv_lengths, a.q_lengths, a.doc_ids, a.doc_kv_ids)
    assert torch.equal(back.to_dense(6, 6, batch=2), mask.to_dense(6, 6, batch=2))
    assert "prefix_lm" in ops.op_args(M.prefix_lm(2) & M.causal(), 6, 6)  # type: ignore[operator]


# ------------------------------------------------------------------ structure
def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, code) with comments and ``literal`` spans in docstrings dropped."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        code = re.sub(r"``[^`]*``", "", line.split("#", 1)[0])
        out.append((n, code))
    return out


# what takes a mask or a score mod apart: allowed in masks/ and scores.py only
TAKING_APART = {
    r"\.conjuncts\(\)": "masks/",
    r"\b(band_of|lengths_of|documents_of)\(": "masks/",
    r"isinstance\([^)]*\b(Band|Lengths|Documents)\b": "masks/",
    r"__wrapped__": "scores.py",
    r"isinstance\([^)]*\b(Alibi|RelativeBias)\b|hasattr\([^)]*slopes": "scores.py",
}


def test_masks_and_score_mods_are_taken_apart_in_one_place() -> None:
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        for pattern, home in TAKING_APART.items():
            if rel.startswith(home):
                continue
            offenders += [f"{rel}:{n}: {code.strip()}" for n, code in _code_lines(path)
                          if re.search(pattern, code)]
    assert not offenders, ("a mask or score mod taken apart outside masks/parts.py / "
                           "scores.score_terms (read Problem.lowered):\n" + "\n".join(offenders))


def test_the_kernel_record_is_named_as_the_operators_schema() -> None:
    """``native.KernelTerms`` is the one spelling of the kernel's score-term and mask
    arguments: the same names, in the same order, as both built operators' schemas."""
    from attnkit.backends import native

    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    ops = native._ops()

    def names(op: object) -> list[str]:
        return [a.name for a in op.default._schema.arguments]  # type: ignore[attr-defined]

    fields = list(native.KernelTerms._fields)
    assert names(ops.attend)[3:-2] == fields                       # q k v … splits block_q
    assert names(ops.attend_backward)[6:-2] == fields    # … dout lse delta … alibi_grad bias_grad
    t = native.plain_terms(0.5, band=(0, 3))
    assert (t.scale, t.band_lo, t.band_hi, t.mask) == (0.5, 0.0, 3.0, None)
