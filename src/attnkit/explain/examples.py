"""The course's worked examples, built in (``attnkit examples`` lists them).

Every example builds its inputs so that the course's numbers come out of the real
computation (``explain`` runs the reference): the raw scores are made by choosing q and k
whose dot products are the stated values. An example may hold several traces — the main
one and a comparison (the same logits ×10, unscaled vs scaled, shared vs separate W).

Shape legend::

    q (n_q, d_k)  k (n_k, d_k)  v (n_k, d_v)      one head
    q (h, n_q, d_k) …                              multi-head: the feature width split in h
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .common import cell_formatter, cut_width, fmt, shape_str
from .strings import STRINGS
from .trace import Trace, explain


@dataclass(frozen=True)
class Example:
    """A named example: ``traces()`` builds its traces (the first is the main one)."""

    name: str
    descriptions: dict[str, str]          # lang → one line
    make: Callable[[], list[Trace]]

    @property
    def description(self) -> str:
        return self.descriptions["en"]

    def describe(self, lang: str = "en") -> str:
        return self.descriptions.get(lang, self.descriptions["en"])

    def traces(self) -> list[Trace]:
        return self.make()

    def build(self) -> Trace:
        """The main trace."""
        return self.make()[0]


def _t(rows: list[list[float]] | np.ndarray) -> torch.Tensor:
    return torch.tensor(np.asarray(rows, dtype=np.float64))


def _text(trace: Trace, title: tuple[str, str], intro: tuple[str, str] | None = None) -> Trace:
    trace.title = {"en": title[0], "ko": title[1]}
    if intro is not None:
        trace.intro = {"en": intro[0], "ko": intro[1]}
    return trace


# ----------------------------------------------------------------------------- (e) causal


def causal_three_tokens() -> list[Trace]:
    """Three tokens, d_k = 4, causal: row 3 of S is [2, 0, 6] → weights [0.114, 0.042, 0.844]."""
    q = _t([[1, 0, 1, 0], [1, -1, 2, 0], [-1, 1, 1, 2]])
    k = _t([[1, -1, 2, 1], [0, -1, 1, 0], [-2, 0, 0, 2]])
    v = torch.cat([torch.eye(3, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64)], 1)
    tr = explain(q, k, v, is_causal=True)
    return [_text(tr, (
        "Three tokens with a causal mask (d_k = 4)",
        "세 토큰과 인과 Mask (d_k = 4)",
    ), (
        "A decoder may not look ahead: token i attends to tokens 1..i only. The causal mask\n"
        "puts −∞ above the diagonal, so row 1 sees one key, row 2 two, row 3 all three.\n"
        "V's first three columns are one-hot, so the output shows the weights themselves.",
        "디코더는 미래 토큰을 볼 수 없습니다: 토큰 i는 토큰 1..i만 봅니다.\n"
        "인과 Mask는 대각선 위에 −∞를 넣으므로 1행은 Key 1개, 2행은 2개, 3행은 3개를 봅니다.\n"
        "V의 앞 세 열이 one-hot이라서 출력에 가중치가 그대로 나타납니다.",
    ))]


# ----------------------------------------------------------------------------- (a) masked


def masked() -> list[Trace]:
    """d_k = 4, raw scores [1.5, 2, 3], mask [0, 0, −∞] → weights [0.44, 0.56, 0]."""
    q = _t([[1, 0, 1, 0]])
    k = _t([[1, 0, 0.5, 0],       # q·k1 = 1.5
            [1, 0, 1, 0],         # q·k2 = 2
            [2, 0, 1, 0]])        # q·k3 = 3  (the best match)
    v = _t([[1, 0], [0, 1], [10, 10]])
    mask = _t([[0, 0, -math.inf]])
    tr = explain(q, k, v, mask=mask)
    return [_text(tr, (
        "Masking: the best-matching key is hidden",
        "Mask: 가장 잘 맞는 Key가 가려짐",
    ), (
        "One query (d_k = 4) and three keys. k3 has the largest raw score, but the mask\n"
        "M = [0, 0, −∞] hides it (think of a future token). Scaling by 1/√4 and adding M\n"
        "gives the logits; e^−∞ = 0, so k3 gets weight 0 and its value [10, 10] never\n"
        "reaches the output — however large its score.",
        "Query 1개(d_k = 4)와 Key 3개. k3의 Score가 가장 크지만 Mask M = [0, 0, −∞]가\n"
        "k3을 가립니다(미래 토큰이라고 생각하세요). √4 = 2로 나누고 M을 더하면 logit이 되고,\n"
        "e^−∞ = 0이므로 k3의 가중치는 0입니다. Score가 아무리 커도 k3의 Value [10, 10]은\n"
        "출력에 닿지 않습니다.",
    ))]


# ----------------------------------------------------------------------------- (b) worked


def worked() -> list[Trace]:
    """q = [1,0,1,0], raw scores [2, 0, 1] → weights [0.51, 0.19, 0.31] → output [0.66, 0.34];
    the same logits ×10 → [0.993, 0.00005, 0.007]."""
    q = _t([[1, 0, 1, 0]])
    k = _t([[1, 0, 1, 0],         # q·k1 = 2
            [0, 1, 0, 1],         # q·k2 = 0
            [1, 0, 0, 0]])        # q·k3 = 1
    v = _t([[1, 0], [0, 1], [0.5, 0.5]])
    main = _text(explain(q, k, v), (
        "The worked example: one query, three keys (d_k = 4)",
        "풀이 예제: Query 1개, Key 3개 (d_k = 4)",
    ), (
        "q = [1, 0, 1, 0]. The keys are chosen so that the raw scores q·k are [2, 0, 1].\n"
        "Scale by 1/√d_k = 1/2, softmax, and mix the three value rows with the weights.",
        "q = [1, 0, 1, 0]. Score q·k가 [2, 0, 1]이 되도록 Key를 골랐습니다.\n"
        "√d_k = 2로 나누고, Softmax를 거쳐, 가중치로 Value의 세 행을 섞습니다.",
    ))
    sharp = _text(explain(q, k, v, scale=10 * 0.5), (
        "The same logits × 10: softmax sharpens",
        "같은 logit × 10: Softmax가 날카로워짐",
    ), (
        "Same q, K, V with scale = 10 · (1/2): the logits become [10, 0, 5]. Softmax only\n"
        "sees differences, and differences ten times larger push almost all the weight\n"
        "onto the best key.",
        "같은 q, K, V에 scale = 10 · (1/2): logit이 [10, 0, 5]가 됩니다. Softmax는 차이만\n"
        "보므로, 차이가 열 배 커지면 가중치가 거의 모두 가장 좋은 Key로 쏠립니다.",
    ))
    return [main, sharp]


# ----------------------------------------------------------------------------- (c) scaling


def scaling() -> list[Trace]:
    """d_k = 64: unscaled logits [16, 8, 0] → [0.9997, 0.0003, ≈0]; ×1/8 → [0.665, 0.245, 0.090]."""
    d_k = 64
    q = np.ones((1, d_k))
    k = np.zeros((3, d_k))
    k[0, :16] = 1                 # q·k1 = 16
    k[1, :8] = 1                  # q·k2 = 8
    k[2] = np.tile([1, -1], d_k // 2)   # q·k3 = 0
    v = np.eye(3)
    raw = _text(explain(_t(q), _t(k), _t(v), scale=1.0), (
        "d_k = 64 without scaling: softmax saturates",
        "d_k = 64, √d_k로 나누지 않으면: Softmax 포화",
    ), (
        "With d_k = 64, dot products grow large: here the raw scores are [16, 8, 0].\n"
        "Used as logits directly (scale = 1), softmax puts nearly all weight on one key.\n"
        "V is the identity, so the output equals the weights.",
        "d_k = 64일 때는 내적이 커집니다: 여기서 Score는 [16, 8, 0]입니다.\n"
        "그대로 logit으로 쓰면(scale = 1) Softmax가 거의 모든 가중치를 Key 하나에 줍니다.\n"
        "V가 단위행렬이라 출력이 곧 가중치입니다.",
    ))
    scaled = _text(explain(_t(q), _t(k), _t(v)), (
        "d_k = 64 scaled by 1/√64 = 1/8",
        "d_k = 64, √64 = 8로 나누면",
    ), (
        "The same scores divided by √64 = 8 become [2, 1, 0]: the weights stay soft,\n"
        "every key keeps a share, and gradients can flow to all of them.",
        "같은 Score를 √64 = 8로 나누면 [2, 1, 0]: 가중치가 부드럽게 유지되어\n"
        "모든 Key가 몫을 갖고, 기울기도 모두에게 흐릅니다.",
    ))
    return [raw, scaled]


# ----------------------------------------------------------------------------- (d) numpy

NUMPY_CODE = """\
import numpy as np
Q = np.array([[1., 0, 1, 0], [0, 1, 0, 1]])   # (2, 4)
K = np.array([[1., 0, 1, 0], [1, 1, 1, 1]])   # (2, 4)
V = np.array([[10., 0], [0, 10]])             # (2, 2)
S = Q @ K.T                                   # (2, 2) raw scores
X = S / np.sqrt(Q.shape[-1])                  # (2, 2) scaled by 1/√d_k
W = np.exp(X - X.max(-1, keepdims=True))      # (2, 2) softmax, max-subtracted
W = W / W.sum(-1, keepdims=True)              #        rows sum to 1
O = W @ V                                     # (2, 2) output"""

# The same code with Korean comments (the code itself is the same: a test runs both).
NUMPY_CODE_KO = (NUMPY_CODE.replace("# (2, 2) raw scores", "# (2, 2) Score")
                 .replace("scaled by 1/√d_k", "√d_k로 나눔")
                 .replace("softmax, max-subtracted", "Softmax (행 최댓값을 먼저 뺌)")
                 .replace("rows sum to 1", "행마다 합이 1")
                 .replace("(2, 2) output", "(2, 2) 출력"))


def two_tokens_numpy() -> list[Trace]:
    """Q = [[1,0,1,0],[0,1,0,1]], K = [[1,0,1,0],[1,1,1,1]], V = [[10,0],[0,10]]."""
    ns: dict[str, np.ndarray] = {}
    exec(NUMPY_CODE, {"np": np}, ns)   # the code shown is the code run
    tr = explain(ns["Q"], ns["K"], ns["V"])
    return [_text(tr, (
        "Two tokens in NumPy",
        "NumPy로 두 토큰",
    ), (
        "The whole computation in plain NumPy (the walkthrough below is the same):\n\n"
        + NUMPY_CODE,
        "NumPy만으로 전체 계산 (아래 풀이와 같은 계산입니다):\n\n" + NUMPY_CODE_KO,
    ))]


# ----------------------------------------------------------------------------- (f) heads


def _heads(x: list[list[float]], heads: int) -> torch.Tensor:
    """(n, h·d) → (h, n, d): cut the feature width into ``heads`` slices."""
    return torch.from_numpy(cut_width(np.asarray(x, dtype=np.float64), heads))


def multihead() -> list[Trace]:
    """T = 3 tokens, d = 8, h = 2: per-head (3, 4) outputs concatenated into (3, 8)."""
    q = [[1, 0, 1, 0, 0, 1, 0, 1], [0, 1, 0, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 1, 1]]
    k = [[1, 0, 0, 0, 0, 1, 1, 0], [0, 1, 1, 0, 1, 0, 0, 1], [1, 0, 1, 1, 0, 0, 0, 1]]
    v = [[1, 0, 0, 0, 2, 0, 0, 0], [0, 1, 0, 0, 0, 2, 0, 0], [0, 0, 1, 0, 0, 0, 2, 1]]
    tr = explain(_heads(q, 2), _heads(k, 2), _heads(v, 2))
    words = ["I", "like", "tea"]
    tr.labelled(words, words)
    return [_text(tr, (
        "Multi-head: T = 3 tokens, d = 8, h = 2 heads",
        "Multi-Head: 토큰 T = 3, d = 8, head h = 2",
    ), (
        "Q, K and V are (3, 8). Two heads each take a 4-wide slice: head 1 columns 1–4,\n"
        "head 2 columns 5–8, so d_k = 8 / 2 = 4 and each head scales by 1/√4. Each head\n"
        "attends on its own and gives a (3, 4) output; concatenating them gives (3, 8).",
        "Q, K, V는 (3, 8)입니다. 두 head가 각각 4칸짜리 조각을 맡습니다: head 1은 1–4열,\n"
        "head 2는 5–8열이므로 d_k = 8 / 2 = 4, 각 head는 √4 = 2로 나눕니다. head마다\n"
        "따로 Attention을 계산해 (3, 4) 출력을 내고, 이어 붙이면 (3, 8) 모양이 됩니다.",
    ))]


# ----------------------------------------------------------------------------- (g) shapes


def shape_walk() -> list[Trace]:
    """The base model: X (10, 512), W_Q (512, 64) per head → Q (10, 64), QKᵀ (10, 10), 8 heads."""
    rng = np.random.default_rng(0)
    n, d_model, h = 10, 512, 8
    d_k = d_model // h
    x = rng.standard_normal((n, d_model))
    w_q, w_k, w_v = (rng.standard_normal((h, d_model, d_k)) / math.sqrt(d_model)
                     for _ in range(3))
    w_o = rng.standard_normal((h * d_k, d_model)) / math.sqrt(h * d_k)
    q, k, v = (np.einsum("nd,hde->hne", x, w) for w in (w_q, w_k, w_v))   # (h, n, d_k)
    tr = explain(_t(q), _t(k), _t(v))
    out = tr.output                                        # (h, n, d_k)
    concat = out.transpose(1, 0, 2).reshape(n, h * d_k)    # (n, h·d_k)
    final = concat @ w_o                                   # (n, d_model)

    def s(a: np.ndarray | tuple[int, ...]) -> str:
        return shape_str(a if isinstance(a, tuple) else a.shape)

    def walk(alike: str, head: str, heads: str, concat_word: str) -> str:
        return "\n  ".join([
            f"X {s(x)}  ·  W_Q {s(w_q[0])}  →  Q {s(q[0])}      {alike}",
            f"Q {s(q[0])}  ·  Kᵀ {s(k[0].T)}  →  QKᵀ {s(tr.scores[0])}",
            f"softmax(QKᵀ / √{d_k}) {s(tr.weights[0])}  ·  V {s(v[0])}  →  {head} "
            f"{s(out[0])}",
            f"{heads}  →  {concat_word} {s(concat)}  ·  W_O {s(w_o)}  →  {s(final)}",
        ])

    tr.options["max_heads"] = 1
    return [_text(tr, (
        f"The base model's shapes: d_model = {d_model}, h = {h}, d_k = {d_k}",
        f"기본 모델의 모양: d_model = {d_model}, h = {h}, d_k = {d_k}",
    ), (
        f"{n} tokens of width {d_model} (seeded random values: only the shapes matter).\n"
        "Each head projects X to its own Q, K, V:\n\n  "
        + walk("(K, V alike)", "head", f"{h} heads", "concat")
        + "\n\nOnly head 1 is printed below; every head has the same shapes.",
        f"폭 {d_model}인 토큰 {n}개 (시드 고정 난수: 모양만 중요합니다).\n"
        "각 head는 X를 자신의 Q, K, V로 사영합니다:\n\n  "
        + walk("(K, V도 같음)", "head 출력", f"head {h}개", "이어붙이기")
        + "\n\n아래에는 head 1만 출력합니다. 모든 head의 모양은 같습니다.",
    ))]


# ----------------------------------------------------------------------------- (h) cross


def cross() -> list[Trace]:
    """Cross-attention: 4 target words (queries) over a 3-word source memory (keys, values)."""
    source = ["나는", "학교에", "간다"]
    target = ["I", "go", "to", "school"]
    k = _t([[2, 0, 0, 1], [0, 2, 0, 1], [0, 0, 2, 1]])        # one key per source word
    q = _t([[2, 0, 0, 0],        # I      → 나는
            [0, 0, 2, 0],        # go     → 간다
            [0, 1, 1, 0],        # to     → 학교에 / 간다
            [0, 2, 0, 0]])       # school → 학교에
    v = torch.eye(3, dtype=torch.float64)                      # one-hot per source word
    tr = explain(q, k, v).labelled(target, source)
    return [_text(tr, (
        "Cross-attention: translating 나는 학교에 간다 → I go to school",
        "Cross-Attention: 나는 학교에 간다 → I go to school 번역",
    ), (
        "The decoder's 4 target words ask (queries); the encoder's 3 source words answer\n"
        "(keys and values). n_q = 4 ≠ n_k = 3, so the weights are (4, 3). V is one-hot per\n"
        "source word: each output row says how much of each source word it carries.",
        "디코더의 목표 단어 4개가 묻고(Query), 인코더의 원문 단어 3개가 답합니다(Key와 Value).\n"
        "n_q = 4 ≠ n_k = 3이므로 가중치는 (4, 3)입니다. V가 원문 단어마다 one-hot이라서\n"
        "출력의 각 행은 원문 단어를 얼마나 담았는지 보여 줍니다.",
    ))]


# ----------------------------------------------------------------------------- (i) shared W


def shared_qk() -> list[Trace]:
    """One W for Q and K makes the raw scores symmetric; separate W_Q, W_K do not."""
    words = ["the", "cat", "sat"]
    x = np.array([[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 0, 1]], dtype=np.float64)
    w = np.array([[1, 0, 0, 1], [0, 1, 1, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=np.float64)
    w_q = w
    w_k = np.array([[0, 1, 0, 0], [1, 0, 0, 1], [0, 0, 1, 0], [1, 1, 0, 0]], dtype=np.float64)
    tied = explain(_t(x @ w), _t(x @ w), _t(x)).labelled(words, words)
    apart = explain(_t(x @ w_q), _t(x @ w_k), _t(x)).labelled(words, words)
    return [_text(tied, (
        "One shared W for Q and K: symmetric scores",
        "Q와 K가 W 하나를 공유: 대칭인 Score",
    ), (
        "Q = X W and K = X W with the same W. Then q_i·k_j = x_i W Wᵀ x_jᵀ = q_j·k_i: the\n"
        "score matrix S equals its transpose, and each token's score with itself is\n"
        "|x_i W|², never negative. The model cannot score 'i looks at j' differently from\n"
        "'j looks at i'.",
        "같은 W로 Q = X W, K = X W. 그러면 q_i·k_j = x_i W Wᵀ x_jᵀ = q_j·k_i: Score 행렬 S가\n"
        "자기 전치와 같고, 토큰이 자기 자신과 얻는 Score는 |x_i W|²이라 음수가 될 수 없습니다.\n"
        "모델은 'i가 j를 본다'와 'j가 i를 본다'에 서로 다른 Score를 줄 수 없습니다.",
    )), _text(apart, (
        "Separate W_Q and W_K: asymmetric scores",
        "W_Q와 W_K를 따로: 비대칭 Score",
    ), (
        "The same X with separate projections W_Q ≠ W_K: S is no longer symmetric, so\n"
        "attention can be one-directional.",
        "같은 X에 서로 다른 사영 W_Q ≠ W_K: S가 더는 대칭이 아니므로, i가 j를 보는 정도와\n"
        "j가 i를 보는 정도가 달라질 수 있습니다.",
    ))]


# ----------------------------------------------------------------------------- overrides


def _row(a: np.ndarray) -> str:
    f = cell_formatter(a)
    return "[" + ", ".join(f(float(x)).replace("-inf", "−∞") for x in a) + "]"


def _said_scale(tr: Trace) -> str:
    d_k = tr.q.shape[-1]
    if math.isclose(tr.scale, 1 / math.sqrt(max(d_k, 1))):
        return f"1/√{d_k} = {fmt(tr.scale)}"
    return fmt(tr.scale)


def with_overrides(traces: list[Trace], scale: float | None = None,
                   softcap: float | None = None) -> list[Trace]:
    """An example's traces recomputed with the learner's scale / soft-cap.

    The example's own text is written for its own values, so it is replaced by one computed
    from the values actually used (the first query row: raw scores → logits → weights, and
    what the example itself used). A comparison trace that sets its own scale (worked's ×10,
    scaling's unscaled half) would print the same numbers as the main one under one
    override: it is left out, and the text says so.
    """
    if scale is None and softcap is None:
        return traces
    defaults = [math.isclose(tr.scale, 1 / math.sqrt(max(tr.q.shape[-1], 1)))
                for tr in traces]
    keep = [traces[0]] + [tr for tr, d in zip(traces[1:], defaults[1:], strict=True)
                          if d and defaults[0]]
    dropped = [tr for tr in traces if all(tr is not k for k in keep)]
    changed = ", ".join(f"{n} = {x:g}" for n, x in (("scale", scale), ("softcap", softcap))
                        if x is not None)
    out = []
    for tr in keep:
        causal = bool(tr.options.get("is_causal"))
        mask = None if causal or tr.allowed.all() else tr.allowed
        new = explain(tr.q, tr.k, tr.v, mask=mask, is_causal=causal, scale=scale,
                      softcap=softcap)
        new.labelled(tr.q_labels, tr.k_labels)
        new.options.update({k: v for k, v in tr.options.items() if k == "max_heads"})
        new.title = {lang: f"{t}  [{changed}]" for lang, t in tr.title.items()}
        row = (0,) * (new.scores.ndim - 1)                     # the first query of head 1
        vals = {"given": changed, "theirs": _said_scale(tr), "scale": fmt(new.scale),
                "s": _row(new.scores[row]), "x": _row(new.logits[row]),
                "w": _row(new.weights[row]), "sum": fmt(float(new.weights[row].sum()))}
        intro = {lang: STRINGS[lang]["ov_intro"].format(**vals) for lang in STRINGS}
        if dropped and tr is keep[0]:
            names = {lang: ", ".join(f"'{d.title.get(lang) or d.title.get('en', '')}'"
                                     for d in dropped) for lang in STRINGS}
            intro = {lang: intro[lang] + "\n" + STRINGS[lang]["ov_dropped"].format(
                names=names[lang]) for lang in STRINGS}
        new.intro = intro
        out.append(new)
    return out


def _ex(name: str, en: str, ko: str, make: Callable[[], list[Trace]]) -> Example:
    return Example(name, {"en": en, "ko": ko}, make)


EXAMPLES: dict[str, Example] = {e.name: e for e in [
    _ex("causal", "three tokens, d_k = 4, causal mask (the default example)",
        "세 토큰, d_k = 4, 인과 Mask (기본 예제)", causal_three_tokens),
    _ex("masked", "the key with the largest raw score is masked and contributes nothing",
        "Score가 가장 큰 Key가 Mask로 가려져 아무것도 기여하지 않음", masked),
    _ex("worked", "one query, raw scores [2, 0, 1], d_k = 4; then the same logits ×10",
        "Query 1개, Score [2, 0, 1], d_k = 4; 이어서 같은 logit ×10", worked),
    _ex("scaling", "d_k = 64: unscaled logits saturate softmax, 1/√d_k fixes it",
        "d_k = 64: √d_k로 나누지 않은 logit은 Softmax를 포화시키고 1/√d_k가 이를 막음", scaling),
    _ex("numpy", "two tokens, the whole computation in plain NumPy",
        "두 토큰, 전체 계산을 NumPy로", two_tokens_numpy),
    _ex("multihead", "T = 3, d = 8, h = 2: two heads of width 4, outputs concatenated",
        "T = 3, d = 8, h = 2: 폭 4인 head 2개, 출력을 이어 붙임", multihead),
    _ex("shapes", "the base model's shape walk: (10, 512) → 8 heads of 64",
        "기본 모델의 모양 따라가기: (10, 512) → 64차원 head 8개", shape_walk),
    _ex("cross", "cross-attention: 4 target words query a 3-word source",
        "Cross-Attention: 목표 단어 4개가 원문 단어 3개에 질의", cross),
    _ex("shared-qk", "one shared W for Q and K gives symmetric scores",
        "Q와 K가 W 하나를 공유하면 Score가 대칭", shared_qk),
]}
DEFAULT = "causal"
