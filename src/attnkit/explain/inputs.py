"""Read a learner's own Q, K, V and mask from files, with errors a learner can act on.

Formats (by extension): ``.npy`` (NumPy), ``.json`` (nested lists of numbers; a mask may
hold ``true``/``false``), ``.csv`` (one row per line, comma-separated; ``-inf`` allowed; a
mask may hold ``true``/``false``).

Shape legend::

    q (n_q, d_k)   k (n_k, d_k)   v (n_k, d_v)   mask (n_q, n_k), (1, n_k) or (n_k,)
    a 1-D file is one row: (d,) → (1, d);  3-D files are (h, n, d): one matrix per head

Every problem raises :class:`InputError`: one line naming the file, the shape seen and what
would fit, in English or Korean (``err.message("ko")``).

Caution
-------
- Size: a ``.npy`` whose header holds more than 16,777,216 values (explain's limit per
  input) is refused before its data is read; a ``.json`` / ``.csv`` file over 256 MB is
  refused unread (save large arrays as ``.npy``). JSON nests at most 4 levels of lists.
- Text files are UTF-8; a byte-order mark (as Excel writes) is accepted.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._outfiles import MESSAGES as _OUTPUT_MESSAGES
from .common import cut_width, shape_str
from .guard import MAX_VALUES

__all__ = ["InputError", "MESSAGES", "UserInputs", "load_array", "load_mask",
           "prepare_inputs", "parse_labels", "finite_number", "shape_str"]

FORMATS = (".npy", ".json", ".csv")
MAX_TEXT_MB = 256            # a .json / .csv file larger than this is refused unread
_TRUE = {"true", "True", "TRUE"}
_FALSE = {"false", "False", "FALSE"}

MESSAGES: dict[str, dict[str, str]] = {
    "en": {
        "csv_empty": "{what} file {path} is empty: write one row of numbers per line",
        "csv_ragged": "{what} file {path}: rows have {n} different lengths, length (rows): "
                      "{lens}; every row needs the same number of comma-separated values",
        "csv_cell": "{what} file {path}: row {i}, column {j} is {cell!r}, not a number "
                    "(use e.g. 0.5, -2 or -inf)",
        "json_bad": "{what} file {path} is not valid JSON ({msg} at line {line}, column {col}): "
                    "write nested lists like [[1, 0], [0, 1]]",
        "json_ragged": "{what} file {path}: the nested lists have rows of different lengths; "
                       "every row needs the same number of values",
        "json_nonnum": "{what} file {path}: expected nested lists of numbers, found {bad!r}",
        "json_deep": "{what} file {path} nests its lists {depth} deep: give (n, d), (h, n, d) "
                     "or (b, h, n, d), at most 4 levels of [ ]",
        "json_huge": "{what} file {path} holds an integer too large for float64 (beyond "
                     "±1.8e308): rescale the values, or write them as floats such as 1e300",
        "ext": "cannot read {what} file {path}: unknown extension {ext!r}; use {formats}",
        "missing": "cannot read {what} file {path}: no such file",
        "file_values": "{what} file {path} holds {n} values {shape}, more than explain's limit "
                       "of {limit} per input: give a slice with fewer rows, columns or heads",
        "file_text": "{what} file {path} is {mb} MB of text, more than {limit} MB: save the "
                     "array as .npy (numpy.save) or give a smaller slice",
        "is_dir": "cannot read {what} file {path}: it is a folder; give a file ({formats})",
        "npy_bad": "cannot read {what} file {path} as .npy ({err}): save it with "
                   "numpy.save(path, array) from a numeric array",
        "npy_dtype": "{what} file {path} holds dtype {dtype}, not numbers: save a numeric (or "
                     "bool) array",
        "os": "cannot read {what} file {path}: {err}",
        "not_utf8": "cannot read {what} file {path}: it is not UTF-8 text (a {ext} file must "
                    "be text)",
        "not_matrix": "--{name} {path} has shape {shape}: give a matrix (n, d) with one row "
                      "per vector",
        "empty_dim": "--{name} {path} has shape {shape}: give at least one row and one column "
                     "of numbers",
        "too_many_dims": "--{name} {path} has shape {shape} ({ndim} dims): give (n, d), "
                         "(h, n, d) or (b, h, n, d)",
        "bool_qkv": "--{name} {path} holds true/false values: Q, K and V need numbers",
        "nonfinite": "--{name} {path} has a non-finite value {val} at index {idx}: Q, K and V "
                     "must hold finite numbers (masks go in --mask)",
        "mask_dims": "--mask {path} has shape {shape}: give ({n_q}, {n_k})",
        "mask_shape": "--mask {path} has shape {shape} but the scores are (n_q, n_k) = "
                      "({n_q}, {n_k}): give a ({n_q}, {n_k}) mask, or (1, {n_k}) for one row "
                      "shared by every query",
        "mask_values": "--mask {path} holds {val}: a number mask is added to the logits, so "
                       "use 0 (keep) or -inf (block)",
        "mask_01": "--mask {path} holds {val}: a number mask is added to the logits, so use 0 "
                   "(keep) or -inf (block) (0/1 looks like keep/block: write true/false "
                   "instead)",
        "heads_divide": "--heads {h} does not divide the feature width of --{name} {path} "
                        "{shape}: {w} / {h} is not whole; use one of {divs}",
        "ndim": "Q, K, V must have the same number of dims; got {seen}: give all as (n, d) or "
                "all as (h, n, d)",
        "d_k": "Q and K need the same width d_k (last dim) for the dot products; got {seen}: "
               "d_k {a} vs {b}, so K should be {fit}",
        "n_k": "K and V need the same number of rows n_k (one value per key); got {seen}: "
               "n_k {a} vs {b}, so V should be {fit}",
        "lead": "Q, K, V must have the same leading (head) dims; got {seen}",
        "heads_min": "--heads must be at least 1, got {h}",
        "heads_3d": "--heads splits (n, d) inputs into heads, but the files already have "
                    "heads: {seen}; drop --heads",
        "causal_and_mask": "give either --causal or --mask, not both (put the causal pattern "
                           "into the mask file)",
        "q_labels": "--q-labels has {n} labels ({text!r}) but there are {m} queries: give {m}, "
                    "comma-separated",
        "k_labels": "--k-labels has {n} labels ({text!r}) but there are {m} keys: give {m}, "
                    "comma-separated",
        "finite": "--{name} must be a finite number, got {x}",
        "decimals": "--decimals must be between 0 and 12, got {d}",
        "plot_steps": "--plot-steps {given!r}: choose from {choices}, comma-separated "
                      "(e.g. scores,weights)",
        "own_only": "{opts}: only for your own inputs; give --q FILE (and --k, --v)",
        "unknown_example": "unknown example {name!r}; choose one of {names} (see `attnkit "
                           "examples`)",
        "example_and_q": "give either --example or your own --q/--k/--v, not both",
        "model_only": "{opts}: not with --model (a model makes its own Q, K, V, scale and "
                      "mask); drop them, or drop --model",
        "needs_model": "{opts}: only with --model NAME (e.g. --model minilm)",
        "unknown_lesson": "unknown lesson {name!r}; choose one of {names} (see `attnkit "
                          "lesson`)",
        "lesson_no_plot": "the lesson {name} has no figure: drop --plot (sqrt-dk has one)",
        "api": "{msg}{files}",
        "write_html": "cannot write --html {path}: {err}",
        "write_plot": "cannot write --plot {path}: {err}",
        "plot_ext": "--plot {path}: heatmaps are written as PNG; give a file name ending in .png",
        "needs_mpl": "--plot needs matplotlib ({err}): pip install \"attnkit[plot]\"",
        **_OUTPUT_MESSAGES["en"],
    },
    "ko": {
        "csv_empty": "{what} 파일 {path}이(가) 비어 있습니다: 한 줄에 숫자 한 행씩 쓰세요",
        "csv_ragged": "{what} 파일 {path}: 행마다 값의 개수가 다릅니다({n}가지). 개수 (행 "
                      "번호): {lens}. 모든 행에 쉼표로 구분한 값이 같은 개수만큼 있어야 "
                      "합니다",
        "csv_cell": "{what} 파일 {path}: {i}행 {j}열의 {cell!r}은(는) 숫자가 아닙니다 "
                    "(예: 0.5, -2, -inf)",
        "json_bad": "{what} 파일 {path}은(는) 올바른 JSON이 아닙니다 ({line}행 {col}열: {msg}): "
                    "[[1, 0], [0, 1]]처럼 중첩 리스트로 쓰세요",
        "json_ragged": "{what} 파일 {path}: 중첩 리스트의 행 길이가 서로 다릅니다; 모든 행의 "
                       "값 개수가 같아야 합니다",
        "json_nonnum": "{what} 파일 {path}: 숫자로 된 중첩 리스트가 필요한데 {bad!r}이(가) "
                       "있습니다",
        "json_deep": "{what} 파일 {path}: 리스트가 {depth}단계로 중첩되어 있습니다: (n, d), "
                     "(h, n, d) 또는 (b, h, n, d)처럼 [ ]를 4단계까지만 쓰세요",
        "json_huge": "{what} 파일 {path}에 float64로 나타낼 수 없는 큰 정수가 있습니다 "
                     "(±1.8e308 밖): 값의 크기를 줄이거나 1e300처럼 지수 표기로 쓰세요",
        "ext": "{what} 파일 {path}을(를) 읽을 수 없습니다: 알 수 없는 확장자 {ext!r}; "
               "{formats} 중 하나를 쓰세요",
        "missing": "{what} 파일 {path}을(를) 읽을 수 없습니다: 파일이 없습니다",
        "file_values": "{what} 파일 {path} {shape}의 값은 {n}개로, 입력 하나에 대한 explain의 "
                       "한도 {limit}개를 넘습니다: 행, 열, head를 줄인 일부만 주세요",
        "file_text": "{what} 파일 {path}: 텍스트 크기가 {mb} MB로 {limit} MB를 넘습니다: 배열을 "
                     ".npy로 저장하거나(numpy.save) 더 작은 일부만 주세요",
        "is_dir": "{what} 파일 {path}을(를) 읽을 수 없습니다: 폴더입니다. 파일({formats})을 "
                  "주세요",
        "npy_bad": "{what} 파일 {path}을(를) .npy로 읽을 수 없습니다 ({err}): 숫자 배열을 "
                   "numpy.save(path, array)로 저장하세요",
        "npy_dtype": "{what} 파일 {path}의 dtype {dtype}은(는) 숫자가 아닙니다: 숫자(또는 bool) "
                     "배열을 저장하세요",
        "os": "{what} 파일 {path}을(를) 읽을 수 없습니다: {err}",
        "not_utf8": "{what} 파일 {path}을(를) 읽을 수 없습니다: UTF-8 텍스트가 아닙니다 "
                    "({ext} 파일은 텍스트여야 합니다)",
        "not_matrix": "--{name} {path}의 모양이 {shape}입니다: 벡터마다 한 행인 (n, d) 행렬을 "
                      "주세요",
        "empty_dim": "--{name} {path}의 모양이 {shape}입니다: 숫자가 적어도 한 행, 한 열은 "
                     "있어야 합니다",
        "too_many_dims": "--{name} {path}의 모양이 {shape}입니다 ({ndim}차원): (n, d), "
                         "(h, n, d) 또는 (b, h, n, d)를 주세요",
        "bool_qkv": "--{name} {path}에 true/false 값이 있습니다: Q, K, V는 숫자여야 합니다",
        "nonfinite": "--{name} {path}의 인덱스 {idx}에 유한하지 않은 값 {val}이(가) 있습니다: "
                     "Q, K, V는 유한한 숫자여야 합니다 (Mask는 --mask로)",
        "mask_dims": "--mask {path}의 모양이 {shape}입니다: "
                     "모양이 ({n_q}, {n_k})인 Mask를 주세요",
        "mask_shape": "--mask {path}의 모양은 {shape}인데 Score는 (n_q, n_k) = ({n_q}, {n_k})"
                      "입니다: ({n_q}, {n_k}) Mask, 또는 모든 Query가 함께 쓰는 한 행 "
                      "(1, {n_k}) 모양의 Mask를 주세요",
        "mask_values": "--mask {path}에 {val}이(가) 있습니다: 숫자 Mask는 logit에 더해지므로 "
                       "0(유지) 또는 -inf(차단)을 쓰세요",
        "mask_01": "--mask {path}에 {val}이(가) 있습니다: 숫자 Mask는 logit에 더해지므로 "
                   "0(유지) 또는 -inf(차단)을 쓰세요 (0/1로 유지/차단을 뜻했다면 true/false로 "
                   "쓰세요)",
        "heads_divide": "--heads {h}은(는) --{name} {path} {shape}의 특징 폭을 나누지 못합니다: "
                        "{w} / {h}이(가) 정수가 아닙니다; {divs} 중 하나를 쓰세요",
        "ndim": "Q, K, V의 차원 수가 같아야 합니다; 받은 것: {seen}: 모두 (n, d) 또는 모두 "
                "(h, n, d)로 주세요",
        "d_k": "내적을 하려면 Q와 K의 폭 d_k(마지막 차원)가 같아야 합니다; 받은 것: {seen}: "
               "d_k {a} 대 {b}. K를 {fit} 모양으로 주세요",
        "n_k": "K와 V의 행 수 n_k가 같아야 합니다 (Key마다 Value 하나); 받은 것: {seen}: "
               "n_k {a} 대 {b}. V를 {fit} 모양으로 주세요",
        "lead": "Q, K, V의 앞쪽(head) 차원이 같아야 합니다; 받은 것: {seen}",
        "heads_min": "--heads는 1 이상이어야 합니다, 받은 값: {h}",
        "heads_3d": "--heads는 (n, d) 입력을 head로 나누는데, 파일에 이미 head가 있습니다: "
                    "{seen}; --heads를 빼세요",
        "causal_and_mask": "--causal과 --mask 중 하나만 주세요 (인과 패턴을 Mask 파일에 "
                           "넣으세요)",
        "q_labels": "--q-labels의 레이블은 {n}개({text!r})인데 Query는 {m}개입니다: 쉼표로 "
                    "구분해 {m}개를 주세요",
        "k_labels": "--k-labels의 레이블은 {n}개({text!r})인데 Key는 {m}개입니다: 쉼표로 "
                    "구분해 {m}개를 주세요",
        "finite": "--{name}은(는) 유한한 숫자여야 합니다, 받은 값: {x}",
        "decimals": "--decimals는 0에서 12 사이여야 합니다, 받은 값: {d}",
        "plot_steps": "--plot-steps {given!r}: {choices} 중에서 쉼표로 구분해 고르세요 "
                      "(예: scores,weights)",
        "own_only": "{opts}: 직접 준 입력에만 쓰입니다; --q FILE (그리고 --k, --v)을 주세요",
        "unknown_example": "알 수 없는 예제 {name!r}; {names} 중 하나를 고르세요 "
                           "(`attnkit examples` 참고)",
        "example_and_q": "--example과 직접 준 --q/--k/--v 중 하나만 주세요",
        "model_only": "{opts}: --model과 함께 쓸 수 없습니다 (모델이 Q, K, V, scale, Mask를 "
                      "스스로 만듭니다). 이 옵션을 빼거나 --model을 빼세요",
        "needs_model": "{opts}: --model NAME과 함께만 씁니다 (예: --model minilm)",
        "unknown_lesson": "알 수 없는 레슨 {name!r}; {names} 중 하나를 고르세요 "
                          "(`attnkit lesson --lang ko` 참고)",
        "lesson_no_plot": "레슨 {name}에는 그림이 없습니다: --plot을 빼세요 (sqrt-dk에는 있음)",
        "api": "입력이 맞지 않습니다 (라이브러리 메시지): {msg}{files}",
        "write_html": "--html {path}에 쓸 수 없습니다: {err}",
        "write_plot": "--plot {path}에 쓸 수 없습니다: {err}",
        "plot_ext": "--plot {path}: 히트맵은 PNG로 저장됩니다. 이름이 .png로 끝나는 파일을 주세요",
        "needs_mpl": "--plot에는 matplotlib가 필요합니다 ({err}): pip install \"attnkit[plot]\"",
        **_OUTPUT_MESSAGES["ko"],
    },
}


class InputError(ValueError):
    """A bad user input: one line, ready for stderr, in English (``str``) or Korean.

    ``InputError(key, **params)`` formats ``MESSAGES[lang][key]``.
    """

    def __init__(self, key: str, **params: Any) -> None:
        self.key, self.params = key, params
        super().__init__(self.message("en"))

    def message(self, lang: str = "en") -> str:
        table = MESSAGES.get(lang, MESSAGES["en"])
        return " ".join(table[self.key].format(**self.params).split("\n"))


def _runs(rows: list[int]) -> list[str]:
    """Sorted 1-based row numbers → ``["1–10", "12"]`` (runs of consecutive rows)."""
    out: list[str] = []
    start = prev = rows[0]
    for r in [*rows[1:], 0]:                                  # 0: the end (rows are >= 1)
        if r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}–{prev}")
        start = prev = r
    return out


def row_lengths(lens: list[int], max_lengths: int = 4, max_runs: int = 3) -> str:
    """Each row length with the rows that have it, bounded for a one-line message:
    ``[4]*10 + [3] + [4]*5`` → ``"4 (1–10, 12–16), 3 (11)"``. The most common length comes
    first; at most ``max_lengths`` lengths (then ``… (+k)``) and ``max_runs`` runs of rows
    each (then "…")."""
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lens, start=1):
        by_len.setdefault(n, []).append(i)
    order = sorted(by_len, key=lambda n: -len(by_len[n]))     # stable: ties by first row
    parts = []
    for n in order[:max_lengths]:
        runs = _runs(by_len[n])
        shown = ", ".join(runs[:max_runs]) + (", …" if len(runs) > max_runs else "")
        parts.append(f"{n} ({shown})")
    if len(order) > max_lengths:
        parts.append(f"… (+{len(order) - max_lengths})")
    return ", ".join(parts)


def _read_csv(path: Path, what: str) -> np.ndarray:
    with path.open(newline="", encoding="utf-8-sig") as f:      # -sig: a BOM (Excel) is fine
        rows = [[c.strip() for c in r] for r in csv.reader(f)]
    rows = [r for r in rows if any(r)]
    if not rows:
        raise InputError("csv_empty", what=what, path=path)
    if len({len(r) for r in rows}) > 1:
        lens = [len(r) for r in rows]
        raise InputError("csv_ragged", what=what, path=path, n=len(set(lens)),
                         lens=row_lengths(lens))
    cells = [c for r in rows for c in r]
    if all(c in _TRUE | _FALSE for c in cells):
        return np.array([[c in _TRUE for c in r] for r in rows], dtype=bool)
    out = np.empty((len(rows), len(rows[0])))
    for i, r in enumerate(rows):
        for j, c in enumerate(r):
            try:
                out[i, j] = float(c)
            except ValueError:
                raise InputError("csv_cell", what=what, path=path, i=i + 1, j=j + 1,
                                 cell=c) from None
    return out


MAX_DEPTH = 4          # (b, h, n, d)


def _depth(data: object) -> int:
    """How deep the first elements nest: ``[[1, 2]]`` → 2 (no recursion: any depth is safe)."""
    d = 0
    while isinstance(data, list):
        d += 1
        if not data:
            break
        data = data[0]
    return d


def _read_json(path: Path, what: str) -> np.ndarray:
    text = path.read_text(encoding="utf-8-sig")        # -sig: a byte-order mark is fine
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError("json_bad", what=what, path=path, msg=e.msg, line=e.lineno,
                         col=e.colno) from None
    except RecursionError:                             # e.g. 100,000 nested [
        lead = re.match(r"[\s\[]*", text)
        depth = lead.group(0).count("[") if lead else 0
        raise InputError("json_deep", what=what, path=path, depth=f"{depth:,}") from None
    except ValueError:                                 # an integer of more than 4300 digits
        raise InputError("json_huge", what=what, path=path) from None
    if _depth(data) > MAX_DEPTH:
        raise InputError("json_deep", what=what, path=path, depth=f"{_depth(data):,}")
    try:
        a = np.array(data)
    except ValueError:
        raise InputError("json_ragged", what=what, path=path) from None
    if a.dtype == bool:
        return a
    try:
        return a.astype(np.float64)        # "-inf" strings are fine
    except OverflowError:                  # a Python int beyond float64
        raise InputError("json_huge", what=what, path=path) from None
    except (ValueError, TypeError):
        raise InputError("json_nonnum", what=what, path=path, bad=_first_bad(data)) from None


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


def _npy_shape(p: Path) -> tuple[int, ...] | None:
    """The shape in a .npy header, without reading the data (None if unreadable)."""
    from numpy.lib import format as npy

    try:
        with p.open("rb") as f:
            major, _ = npy.read_magic(f)
            read = {1: npy.read_array_header_1_0, 2: npy.read_array_header_2_0}.get(major)
            return tuple(int(s) for s in read(f)[0]) if read else None
    except (ValueError, OSError, EOFError, TypeError):
        return None                                     # np.load gives the precise error


def load_array(path: str | Path, what: str = "input") -> np.ndarray:
    """Read a ``.npy``, ``.json`` or ``.csv`` file into a NumPy array (bool kept for masks)."""
    p = Path(path)
    ext = p.suffix.lower()
    if p.is_dir():
        raise InputError("is_dir", what=what, path=p, formats=", ".join(FORMATS))
    if ext not in FORMATS:
        raise InputError("ext", what=what, path=p, ext=ext or "(none)",
                         formats=", ".join(FORMATS))
    if not p.is_file():
        raise InputError("missing", what=what, path=p)
    try:
        if ext == ".npy":
            shape = _npy_shape(p)
            if shape is not None and math.prod(shape) > MAX_VALUES:   # refuse before reading
                raise InputError("file_values", what=what, path=p, shape=shape_str(shape),
                                 n=f"{math.prod(shape):,}", limit=f"{MAX_VALUES:,}")
            try:
                a = np.load(p, allow_pickle=False)
            except ValueError as e:
                raise InputError("npy_bad", what=what, path=p, err=e) from None
            if not isinstance(a, np.ndarray) or a.dtype.kind not in "biuf":
                raise InputError("npy_dtype", what=what, path=p,
                                 dtype=getattr(a, "dtype", "?"))
            return a if a.dtype == bool else a.astype(np.float64)
        size = p.stat().st_size
        if size > MAX_TEXT_MB * 2 ** 20:
            raise InputError("file_text", what=what, path=p, mb=f"{size / 2 ** 20:,.0f}",
                             limit=MAX_TEXT_MB)
        if ext == ".json":
            return _read_json(p, what)
        return _read_csv(p, what)
    except OSError as e:
        raise InputError("os", what=what, path=p, err=e.strerror or e) from None
    except UnicodeDecodeError:
        raise InputError("not_utf8", what=what, path=p, ext=ext) from None


def _as_matrix(a: np.ndarray, name: str, path: str) -> np.ndarray:
    if a.ndim == 0:
        raise InputError("not_matrix", name=name, path=path, shape=shape_str(a.shape))
    if 0 in a.shape:
        raise InputError("empty_dim", name=name, path=path, shape=shape_str(a.shape))
    if a.ndim == 1:
        a = a[None, :]                          # (d,) → one row (1, d)
    if a.ndim > 4:
        raise InputError("too_many_dims", name=name, path=path, shape=shape_str(a.shape),
                         ndim=a.ndim)
    if a.dtype == bool:
        raise InputError("bool_qkv", name=name, path=path)
    if not np.isfinite(a).all():
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
        raise InputError("nonfinite", name=name, path=path, val=a[idx], idx=idx)
    return a


def load_mask(path: str | Path, n_q: int, n_k: int) -> np.ndarray:
    """A mask file → bool (True = may attend) or float (0 = keep, −inf = block) array.

    The mask must broadcast to ``(n_q, n_k)`` (or ``(h, n_q, n_k)``).
    """
    m = load_array(path, "mask")
    if m.ndim == 1:
        m = m[None, :]
    if m.ndim == 0 or m.ndim > 4:
        raise InputError("mask_dims", path=path, shape=shape_str(m.shape), n_q=n_q, n_k=n_k)
    rows, cols = m.shape[-2:]
    if rows not in (1, n_q) or cols not in (1, n_k):
        raise InputError("mask_shape", path=path, shape=shape_str(m.shape), n_q=n_q, n_k=n_k)
    if m.dtype != bool:
        ok = (m == 0) | np.isneginf(m)
        if not ok.all():
            bad = m[~ok]
            key = "mask_01" if np.isin(bad, [1.0]).all() else "mask_values"
            raise InputError(key, path=path, val=f"{bad.flat[0]:g}")
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
    width = a.shape[1]
    if width % heads:
        divs = [d for d in range(1, width + 1) if width % d == 0]
        raise InputError("heads_divide", h=heads, name=name, path=path,
                         shape=shape_str(a.shape), w=width, divs=", ".join(map(str, divs)))
    return cut_width(a, heads)                                            # (h, n, d/h)


def prepare_inputs(q_path: str, k_path: str | None = None, v_path: str | None = None, *,
                   mask_path: str | None = None, heads: int | None = None,
                   causal: bool = False) -> UserInputs:
    """Read and cross-check the files: k defaults to q, v to k (self-attention)."""
    k_path = k_path or q_path
    v_path = v_path or k_path
    paths = {"q": q_path, "k": k_path, "v": v_path}
    arrs = {n: _as_matrix(load_array(p, n.upper()), n, p) for n, p in paths.items()}
    q, k, v = arrs["q"], arrs["k"], arrs["v"]
    seen = ", ".join(f"--{n} {paths[n]} {shape_str(a.shape)}" for n, a in arrs.items())
    if not q.ndim == k.ndim == v.ndim:
        raise InputError("ndim", seen=seen)
    if q.shape[-1] != k.shape[-1]:
        raise InputError("d_k", seen=seen, a=q.shape[-1], b=k.shape[-1],
                         fit=shape_str((*k.shape[:-1], q.shape[-1])))
    if k.shape[-2] != v.shape[-2]:
        raise InputError("n_k", seen=seen, a=k.shape[-2], b=v.shape[-2],
                         fit=shape_str((*v.shape[:-2], k.shape[-2], v.shape[-1])))
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        raise InputError("lead", seen=seen)
    h = 1
    if heads is not None:
        if heads < 1:
            raise InputError("heads_min", h=heads)
        if q.ndim != 2:
            raise InputError("heads_3d", seen=seen)
        q, k, v = (_split(a, heads, n, paths[n]) for n, a in (("q", q), ("k", k), ("v", v)))
        h = heads
    mask = None
    if mask_path is not None:
        if causal:
            raise InputError("causal_and_mask")
        mask = load_mask(mask_path, q.shape[-2], k.shape[-2])
    return UserInputs(q, k, v, mask, h)


def parse_labels(text: str | None, n: int, what: str) -> list[str] | None:
    """``"I,go,home"`` → ``["I", "go", "home"]``; the count must match the rows."""
    if text is None:
        return None
    labels = [s.strip() for s in text.split(",")]
    if len(labels) != n:
        raise InputError(f"{what}_labels", n=len(labels), text=text, m=n)
    return labels


def finite_number(x: float, name: str) -> float:
    """``x`` if finite, else an :class:`InputError` naming the option."""
    if not math.isfinite(x):
        raise InputError("finite", name=name, x=x)
    return x
