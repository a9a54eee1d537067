"""Read a learner's own Q, K, V and mask from files, with errors a learner can act on.

Formats (by extension): ``.npy`` (NumPy), ``.json`` (nested lists of numbers; a mask may
hold ``true``/``false``), ``.csv`` (one row per line, comma-separated; ``-inf`` allowed; a
mask may hold ``true``/``false``).

Shape legend::

    q (n_q, d_k)   k (n_k, d_k)   v (n_k, d_v)   mask (n_q, n_k), (1, n_k) or (n_k,)
    a 1-D file is one row: (d,) → (1, d);  3-D files are (h, n, d): one matrix per head

Every problem raises :class:`InputError` with one line naming the file, the shape seen and
what would fit.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["InputError", "UserInputs", "load_array", "load_mask", "prepare_inputs",
           "shape_str"]

FORMATS = (".npy", ".json", ".csv")
_TRUE = {"true", "True", "TRUE"}
_FALSE = {"false", "False", "FALSE"}


class InputError(ValueError):
    """A bad user input: the message is one line, ready for stderr."""


def shape_str(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + (",)" if len(shape) == 1 else ")")


def _read_csv(path: Path, what: str) -> np.ndarray:
    with path.open(newline="", encoding="utf-8") as f:
        rows = [[c.strip() for c in r] for r in csv.reader(f)]
    rows = [r for r in rows if any(r)]
    if not rows:
        raise InputError(f"{what} file {path} is empty: write one row of numbers per line")
    widths = {len(r) for r in rows}
    if len(widths) > 1:
        lens = [len(r) for r in rows]
        raise InputError(f"{what} file {path}: rows have different lengths {lens}; every row "
                         "needs the same number of comma-separated values")
    cells = [c for r in rows for c in r]
    if all(c in _TRUE | _FALSE for c in cells):
        return np.array([[c in _TRUE for c in r] for r in rows], dtype=bool)
    out = np.empty((len(rows), len(rows[0])))
    for i, r in enumerate(rows):
        for j, c in enumerate(r):
            try:
                out[i, j] = float(c)
            except ValueError:
                raise InputError(f"{what} file {path}: row {i + 1}, column {j + 1} is {c!r}, "
                                 "not a number (use e.g. 0.5, -2 or -inf)") from None
    return out


def _read_json(path: Path, what: str) -> np.ndarray:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InputError(f"{what} file {path} is not valid JSON ({e.msg} at line {e.lineno}, "
                         f"column {e.colno}): write nested lists like [[1, 0], [0, 1]]") from None
    try:
        a = np.array(data)
    except ValueError:
        raise InputError(f"{what} file {path}: the nested lists have rows of different "
                         "lengths; every row needs the same number of values") from None
    if a.dtype == bool:
        return a
    if a.dtype.kind in "iuf":
        return a.astype(np.float64)
    try:
        return a.astype(np.float64)        # "-inf" strings are fine
    except (ValueError, TypeError):
        raise InputError(f"{what} file {path}: expected nested lists of numbers, found "
                         f"{_first_bad(data)!r}") from None


def _first_bad(data: object) -> object:
    if isinstance(data, list):
        for x in data:
            bad = _first_bad(x)
            if bad is not None:
                return bad
        return None
    if isinstance(data, (int, float, bool)):
        return None
    try:
        float(data)  # type: ignore[arg-type]
        return None
    except (TypeError, ValueError):
        return data


def load_array(path: str | Path, what: str = "input") -> np.ndarray:
    """Read a ``.npy``, ``.json`` or ``.csv`` file into a NumPy array (bool kept for masks)."""
    p = Path(path)
    ext = p.suffix.lower()
    if ext not in FORMATS:
        raise InputError(f"cannot read {what} file {p}: unknown extension {ext or '(none)'!r}; "
                         f"use {', '.join(FORMATS)}")
    if not p.is_file():
        raise InputError(f"cannot read {what} file {p}: no such file")
    try:
        if ext == ".npy":
            try:
                a = np.load(p, allow_pickle=False)
            except ValueError as e:
                raise InputError(f"cannot read {what} file {p} as .npy ({e}): save it with "
                                 "numpy.save(path, array) from a numeric array") from None
            if not isinstance(a, np.ndarray) or a.dtype.kind not in "biuf":
                raise InputError(f"{what} file {p} holds dtype {getattr(a, 'dtype', '?')}, not "
                                 "numbers: save a numeric (or bool) array")
            return a if a.dtype == bool else a.astype(np.float64)
        if ext == ".json":
            return _read_json(p, what)
        return _read_csv(p, what)
    except OSError as e:
        raise InputError(f"cannot read {what} file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise InputError(f"cannot read {what} file {p}: it is not UTF-8 text "
                         f"(a {ext} file must be text)") from None


def _as_matrix(a: np.ndarray, name: str, path: str) -> np.ndarray:
    if a.ndim == 0 or a.size == 0 and a.ndim == 1:
        raise InputError(f"--{name} {path} has shape {shape_str(a.shape)}: give a matrix "
                         f"(n, d) — one row per {'query' if name == 'q' else 'key'}")
    if a.ndim == 1:
        a = a[None, :]                          # (d,) → one row (1, d)
    if a.ndim <= 4 and 0 in a.shape:
        raise InputError(f"--{name} {path} has shape {shape_str(a.shape)}: give at least one "
                         "row and one column of numbers")
    if a.ndim > 4:
        raise InputError(f"--{name} {path} has shape {shape_str(a.shape)} ({a.ndim} dims): "
                         "give (n, d), (h, n, d) or (b, h, n, d)")
    if a.dtype == bool:
        raise InputError(f"--{name} {path} holds true/false values: Q, K and V need numbers")
    if not np.isfinite(a).all():
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
        raise InputError(f"--{name} {path} has a non-finite value {a[idx]} at index {idx}: "
                         "Q, K and V must hold finite numbers (masks go in --mask)")
    return a


def load_mask(path: str | Path, n_q: int, n_k: int) -> np.ndarray:
    """A mask file → bool (True = may attend) or float (0 = keep, −inf = block) array.

    The mask must broadcast to ``(n_q, n_k)`` (or ``(h, n_q, n_k)``).
    """
    m = load_array(path, "mask")
    if m.ndim == 1:
        m = m[None, :]
    if m.ndim == 0 or m.ndim > 4:
        raise InputError(f"--mask {path} has shape {shape_str(m.shape)}: give ({n_q}, {n_k})")
    rows, cols = m.shape[-2:]
    if rows not in (1, n_q) or cols not in (1, n_k):
        raise InputError(
            f"--mask {path} has shape {shape_str(m.shape)} but the scores are (n_q, n_k) = "
            f"({n_q}, {n_k}): give a ({n_q}, {n_k}) mask, or (1, {n_k}) for one row shared by "
            "every query")
    if m.dtype != bool:
        ok = (m == 0) | np.isneginf(m)
        if not ok.all():
            bad = m[~ok]
            hint = (" (0/1 looks like keep/block: write true/false instead)"
                    if np.isin(bad, [1.0]).all() else "")
            raise InputError(
                f"--mask {path} holds {bad.flat[0]:g}: a number mask is added to the logits, "
                f"so use 0 (keep) or -inf (block){hint}")
    return m


@dataclass
class UserInputs:
    """Q, K, V (and mask) read from files and checked against each other."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None
    heads: int


def _split(a: np.ndarray, heads: int, name: str, path: str) -> np.ndarray:
    n, width = a.shape
    if width % heads:
        divs = [d for d in range(1, width + 1) if width % d == 0]
        raise InputError(
            f"--heads {heads} does not divide the feature width of --{name} {path} "
            f"{shape_str(a.shape)}: {width} / {heads} is not whole; use one of "
            f"{', '.join(map(str, divs))}")
    return a.reshape(n, heads, width // heads).transpose(1, 0, 2).copy()   # (h, n, d/h)


def prepare_inputs(q_path: str, k_path: str | None = None, v_path: str | None = None, *,
                   mask_path: str | None = None, heads: int | None = None,
                   causal: bool = False) -> UserInputs:
    """Read and cross-check the files: k defaults to q, v to k (self-attention)."""
    k_path = k_path or q_path
    v_path = v_path or k_path
    paths = {"q": q_path, "k": k_path, "v": v_path}
    arrs = {n: _as_matrix(load_array(p, n.upper()), n, p) for n, p in paths.items()}
    q, k, v = arrs["q"], arrs["k"], arrs["v"]

    def seen() -> str:
        return ", ".join(f"--{n} {paths[n]} {shape_str(a.shape)}" for n, a in arrs.items())

    if not q.ndim == k.ndim == v.ndim:
        raise InputError(f"Q, K, V must have the same number of dims; got {seen()}: give all "
                         "as (n, d) or all as (h, n, d)")
    if q.shape[-1] != k.shape[-1]:
        raise InputError(
            f"Q and K need the same width d_k (last dim) for the dot products; got {seen()}: "
            f"d_k {q.shape[-1]} vs {k.shape[-1]}, so K should be "
            f"{shape_str((*k.shape[:-1], q.shape[-1]))}")
    if k.shape[-2] != v.shape[-2]:
        raise InputError(
            f"K and V need the same number of rows n_k (one value per key); got {seen()}: "
            f"n_k {k.shape[-2]} vs {v.shape[-2]}, so V should be "
            f"{shape_str((*v.shape[:-2], k.shape[-2], v.shape[-1]))}")
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        raise InputError(f"Q, K, V must have the same leading (head) dims; got {seen()}")
    h = 1
    if heads is not None:
        if heads < 1:
            raise InputError(f"--heads must be at least 1, got {heads}")
        if q.ndim != 2:
            raise InputError(f"--heads splits (n, d) inputs into heads, but the files already "
                             f"have heads: {seen()}; drop --heads")
        q, k, v = (_split(a, heads, n, paths[n]) for n, a in (("q", q), ("k", k), ("v", v)))
        h = heads
    mask = None
    if mask_path is not None:
        if causal:
            raise InputError("give either --causal or --mask, not both (put the causal "
                             "pattern into the mask file)")
        mask = load_mask(mask_path, q.shape[-2], k.shape[-2])
    return UserInputs(q, k, v, mask, h)


def parse_labels(text: str | None, n: int, what: str) -> list[str] | None:
    """``"I,go,home"`` → ``["I", "go", "home"]``; the count must match the rows."""
    if text is None:
        return None
    labels = [s.strip() for s in text.split(",")]
    if len(labels) != n:
        raise InputError(f"--{what}-labels has {len(labels)} labels ({text!r}) but there are "
                         f"{n} {'queries' if what == 'q' else 'keys'}: give {n}, comma-separated")
    return labels


def finite_number(x: float, name: str) -> float:
    if not math.isfinite(x):
        raise InputError(f"--{name} must be a finite number, got {x}")
    return x
