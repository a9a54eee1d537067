"""``tiny-ko``: a tiny Korean character-level causal Transformer, trained here.

No pretrained Korean or causal model can be downloaded, so attnkit trains one: a
character-level language model built from attnkit's own layers
(:class:`~attnkit.layers.MultiHeadAttention` with rotary positions, :class:`RMSNorm`) on a
short Korean text about Attention that ships with the package (``tiny_ko.txt``, written for
the project). ``attnkit train-tiny`` (or the first ``attnkit explain --model tiny-ko``)
trains it in a few seconds on two CPU cores and caches it; :func:`capture` then runs it on
any text and keeps every layer's real Q, K, V and the next-token logits, which
:func:`attnkit.explain.model.explain_model` turns into a ``ModelTrace``.

The model, one block per layer (pre-norm, as Llama)::

    ids (B, N) → embed E (B, N, d)
    × n_layers:  x += MHA(RMSNorm(x), causal, RoPE θ=100)   q, k, v (B, H, N, d_h)
                 x += W_2 GELU(W_1 RMSNorm(x))               (B, N, 4d) → (B, N, d)
    RMSNorm → logits = x Eᵀ / √d (tied to the embedding)     (B, N, V)

(The projections have biases: with rotary positions a bias alone gives a query a score that
depends only on the distance to the key, so positional heads are easy to learn.) Each
training window joins sentences of the text drawn at random, so what surrounds a sentence
says little about it and the order of its characters is what the model must read: local
heads emerge (one of layer 2 gives the three characters before each query most of its
weight; the page walks through it first, see :func:`local_score`).

Shape legend::

    B batch   N characters (≤ context)   d d_model   H heads   d_h = d / H   V vocabulary

Training is deterministic: the weights start from ``torch.manual_seed(seed)`` (inside
:func:`torch.random.fork_rng`, so the caller's random state is untouched), the windows are
drawn from a :class:`torch.Generator` of the same seed, and the loop runs single-threaded
(a fixed order of every sum); two runs of one :class:`TinyConfig` give identical weights.

Caution
-------
- The vocabulary is the characters of the training text (plus ``UNKNOWN``): any other
  character of a text given to the model is read as ``UNKNOWN`` (the output says how
  many).
- The model has learnt one short text by heart, nothing more: its predictions are good on
  the text's own sentences and poor elsewhere.
- The cache is ``$ATTNKIT_CACHE_DIR`` (or ``$XDG_CACHE_HOME/attnkit``, ``~/.cache/attnkit``)
  ``/tiny-ko/<key>.pt``, the key a hash of the text, the configuration and this format's
  version; an unreadable file is trained again. Training needs no network.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

__all__ = ["NAME", "TinyConfig", "TinyLM", "Vocab", "corpus", "train", "load_or_train",
           "cached", "cache_path", "capture", "Captured", "DEFAULT_TEXT", "UNKNOWN",
           "previous_token_score", "local_score", "local_head", "offset_weight", "sentences"]

NAME = "tiny-ko"
FORMAT = 1                                   # bump when the saved file's layout changes
UNKNOWN = "\ufffd"                           # a character the training text never had
DEFAULT_TEXT = "둘째 단계에서는 Score를 √d_k로 나"    # the model completes it: 눕니다


@dataclass(frozen=True)
class TinyConfig:
    """The model's size and its training (the defaults train in a few seconds on 2 cores)."""

    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    context: int = 64                        # characters per training window (and at most)
    rope_theta: float = 100.0                # θ of the rotary positions (small: sharp offsets)
    steps: int = 300
    batch: int = 16
    lr: float = 3e-2
    seed: int = 0


def corpus() -> str:
    """The Korean text the model learns (shipped with the package)."""
    return resources.files(__package__).joinpath("tiny_ko.txt").read_text(encoding="utf-8")


class Vocab:
    """Characters ↔ ids: the training text's characters, sorted, after ``UNKNOWN`` (id 0)."""

    def __init__(self, chars: list[str]) -> None:
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def of(cls, text: str) -> Vocab:
        return cls([UNKNOWN] + sorted(set(text) - {UNKNOWN}))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [self.index.get(c, 0) for c in text]

    @staticmethod
    def label(c: str) -> str:
        """How a character is shown: a space as ␣, a line break as ⏎."""
        return {" ": "␣", "\n": "⏎", "\t": "⇥"}.get(c, c)


class Block(nn.Module):
    """One pre-norm Transformer block: causal self-attention with RoPE, then an MLP."""

    def __init__(self, d: int, heads: int, theta: float) -> None:
        super().__init__()
        from ..layers import MultiHeadAttention, RMSNorm, RoPE

        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.attn = MultiHeadAttention(d, heads, bias=True, rope=RoPE(theta=theta))
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, record: list[dict[str, Any]] | None = None,
                ) -> torch.Tensor:
        h = self.norm1(x)                                        # (B, N, d)
        if record is not None:                  # the layer's own q, k, v, as it attends
            a = self.attn
            q, k = a.rotate_qk(a.project_q(h), a.project_k(h), None, None)   # (B, H, N, d_h)
            record.append({"q": q.detach(), "k": k.detach(), "v": a.project_v(h).detach(),
                           "mask": None, "causal": True, "scale": a.scale})
        x = x + self.attn(h, is_causal=True)                     # (B, N, d)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """The character-level causal language model (see the module docstring)."""

    def __init__(self, vocab_size: int, cfg: TinyConfig) -> None:
        super().__init__()
        from ..layers import RMSNorm

        self.cfg = cfg
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads, cfg.rope_theta)
                                    for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.out_scale = 1 / math.sqrt(cfg.d_model)     # logits of size ~1 at the start

    def forward(self, ids: torch.Tensor, record: list[dict[str, Any]] | None = None,
                ) -> torch.Tensor:
        """ids (B, N) → next-character logits (B, N, V); ``record`` collects each layer's
        q, k, v (B, H, N, d_h)."""
        x = self.embed(ids)                                      # (B, N, d)
        for block in self.blocks:
            x = block(x, record)
        return self.norm(x) @ self.embed.weight.T * self.out_scale  # (B, N, V)


# ----------------------------------------------------------------------------- training


class _Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal; on a pipe, a line
    at every quarter)."""

    def __init__(self, total: int, what: str, out: TextIO | None) -> None:
        self.total, self.what, self.out = total, what, out
        self.start = time.perf_counter()
        self.tty = bool(out is not None and getattr(out, "isatty", lambda: False)())
        self.shown = -1

    def update(self, step: int, loss: float) -> None:
        if self.out is None:
            return
        quarter = 4 * step // self.total
        if not self.tty and quarter == self.shown and step != self.total:
            return
        self.shown = quarter
        filled = round(24 * step / self.total)
        line = (f"{self.what} [{'#' * filled}{'.' * (24 - filled)}] {step}/{self.total} "
                f"loss {loss:.3f} {time.perf_counter() - self.start:.1f} s")
        self.out.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and step == self.total:
            self.out.write("\n")
        self.out.flush()


def sentences(text: str) -> list[str]:
    """The text cut after each sentence's full stop (and at line breaks): the pieces the
    training windows are made of."""
    out = []
    for line in text.splitlines():
        out += [p.strip() + "." for p in line.split(". ") if p.strip()]
    return [p[:-1] if p.endswith("..") else p for p in out]


def _windows(pieces: list[torch.Tensor], space: int, cfg: TinyConfig,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of windows, each of sentences drawn at random and joined by spaces (so the
    characters around a sentence say little about it and the order within it is what
    counts): inputs (B, N) and the next characters (B, N)."""
    n = cfg.context
    rows = []
    for _ in range(cfg.batch):
        got: list[torch.Tensor] = []
        size = 0
        while size < n + 1:                                   # enough for N + 1 characters
            piece = pieces[int(torch.randint(len(pieces), (1,), generator=gen))]
            got += [piece, torch.tensor([space])]
            size += piece.numel() + 1
        row = torch.cat(got)                                  # (≥ N + 1,)
        start = int(torch.randint(row.numel() - n, (1,), generator=gen))
        rows.append(row[start:start + n + 1])
    batch = torch.stack(rows)                                 # (B, N + 1)
    return batch[:, :-1], batch[:, 1:]


def train(cfg: TinyConfig = TinyConfig(), *, text: str | None = None,
          progress: TextIO | None = None) -> tuple[TinyLM, Vocab, list[float]]:
    """Train the model on ``text`` (default :func:`corpus`): (model in eval mode, vocab,
    the loss of every step). ``progress``: a stream for the progress bar (None: quiet)."""
    from .. import backends

    text = corpus() if text is None else text
    vocab = Vocab.of(text)
    pieces = [torch.tensor(vocab.encode(p)) for p in sentences(text)]
    space = vocab.index[" "]
    threads = torch.get_num_threads()
    losses: list[float] = []
    bar = _Progress(cfg.steps, f"attnkit: training {NAME}", progress)
    with torch.random.fork_rng(devices=[]), backends.use("reference"):
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(1)                 # one order of every sum: the same weights
        try:
            model = TinyLM(len(vocab), cfg)
            gen = torch.Generator().manual_seed(cfg.seed)
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
            for step in range(cfg.steps):
                lr = cfg.lr * min(1.0, (step + 1) / 20) * (
                    0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / cfg.steps)))
                for g in opt.param_groups:
                    g["lr"] = lr
                x, y = _windows(pieces, space, cfg, gen)                # (B, N) each
                logits = model(x)                                        # (B, N, V)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
                bar.update(step + 1, losses[-1])
        finally:
            torch.set_num_threads(threads)
    return model.eval(), vocab, losses


# ------------------------------------------------------------------------------- cache


def _key(cfg: TinyConfig, text: str) -> str:
    blob = json.dumps({"format": FORMAT, "config": asdict(cfg), "text": text},
                      sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def cache_root() -> Path:
    """The folder of the cached models: attnkit's cache (the native kernel's too) / tiny-ko."""
    from ..backends.native.loader import cache_dir

    return cache_dir() / NAME


def cache_path(cfg: TinyConfig = TinyConfig()) -> Path:
    """Where the model trained with ``cfg`` on the shipped text is (or will be) cached."""
    return cache_root() / f"{_key(cfg, corpus())}.pt"


def cached(cfg: TinyConfig = TinyConfig()) -> tuple[TinyLM, Vocab, list[float]] | None:
    """The cached model, vocab and losses, or None when there is none (or it is unreadable)."""
    path = cache_path(cfg)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        vocab = Vocab(list(saved["vocab"]))
        model = TinyLM(len(vocab), cfg)
        model.load_state_dict(saved["weights"])
    except (OSError, RuntimeError, KeyError, ValueError, TypeError, EOFError):
        return None
    return model.eval(), vocab, [float(x) for x in saved["losses"]]


def _save(path: Path, model: TinyLM, vocab: Vocab, losses: list[float]) -> None:
    """Write atomically (a temporary file renamed), so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"weights": model.state_dict(), "vocab": vocab.chars,
                        "losses": losses, "config": asdict(model.cfg)}, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _stream(progress: TextIO | str | None) -> TextIO | None:
    """``"stderr"``: the process's stderr now (not at import: pytest, notebooks swap it)."""
    return sys.stderr if progress == "stderr" else progress  # type: ignore[return-value]


def load_or_train(cfg: TinyConfig = TinyConfig(), *, progress: TextIO | str | None = "stderr",
                  retrain: bool = False) -> tuple[TinyLM, Vocab, list[float], bool]:
    """(model, vocab, losses, trained now): the cached model, else trained and cached.

    A cache that cannot be written (a read-only home) is not an error: the model trained
    now is used and the progress stream says why it was not kept."""
    progress = _stream(progress)
    if not retrain:
        got = cached(cfg)
        if got is not None:
            return (*got, False)
    model, vocab, losses = train(cfg, progress=progress)
    try:
        _save(cache_path(cfg), model, vocab, losses)
    except OSError as e:
        if progress is not None:
            progress.write(f"attnkit: the trained {NAME} could not be cached at "
                           f"{cache_path(cfg)} ({e.strerror or e}); set ATTNKIT_CACHE_DIR "
                           "to a writable folder\n")
    return model, vocab, losses, True


# ----------------------------------------------------------------------------- capture


@dataclass
class Captured:
    """One run of the model on a text: what :func:`explain_model` needs."""

    tokens: list[str]                    # one label per character (␣ for a space)
    record: list[dict[str, Any]]         # per layer: q, k, v (1, H, n, d_h), causal
    logits: torch.Tensor                 # (n, V): the next character's logits at each position
    vocab: list[str]                     # the labels of the V characters
    unknown: int                         # characters of the text the vocabulary lacks
    d_model: int


def capture(text: str, cfg: TinyConfig = TinyConfig(), *,
            progress: TextIO | str | None = "stderr") -> Captured:
    """Run the (cached, else trained now) model on ``text``, at most ``cfg.context``
    characters (the last ones are kept: they lead to the next character)."""
    from .. import backends

    model, vocab, _, _ = load_or_train(cfg, progress=progress)
    text = text[-cfg.context:]
    ids = torch.tensor([vocab.encode(text)])                     # (1, n)
    record: list[dict[str, Any]] = []
    with torch.no_grad(), backends.use("reference"):
        logits = model(ids, record)[0]                           # (n, V)
    return Captured(tokens=[Vocab.label(c) for c in text], record=record,
                    logits=logits.double(), vocab=[Vocab.label(c) for c in vocab.chars],
                    unknown=sum(i == 0 for i in ids[0].tolist()), d_model=cfg.d_model)


def offset_weight(weights: Any, offsets: tuple[int, ...] = (1,)) -> Any:
    """Each head's mean weight on the tokens ``offsets`` places back: weights (L, H, n, n)
    → (L, H), the mean over queries i ≥ max(offsets) of Σ_o w[i, i−o] (zeros when the text
    is shorter). ``(1,)``: a previous-token head; ``(1, 2, 3)``: a local head."""
    import numpy as np

    w = np.asarray(weights)
    n, back = w.shape[-1], max(offsets)
    if n <= back:
        return np.zeros(w.shape[:2])
    i = np.arange(back, n)                                       # queries with every offset
    return sum(w[..., i, i - o] for o in offsets).mean(-1)       # (L, H)


def previous_token_score(weights: Any) -> Any:
    """Each head's mean weight on the token just before the query: (L, H)."""
    return offset_weight(weights, (1,))


LOCAL = (1, 2, 3)


def local_score(weights: Any) -> Any:
    """Each head's mean weight on the three tokens just before the query: (L, H) (a head
    spread evenly over a causal row of n tokens scores about 3·ln(n)/n)."""
    return offset_weight(weights, LOCAL)


def local_head(weights: Any, least: float = 0.5) -> tuple[int, int, float, float] | None:
    """(layer, head, its local score, an even head's) for the most local head, 1-based,
    when it gives the three tokens before each query more than ``least`` of its weight;
    None otherwise (or for a text of at most three tokens)."""
    import numpy as np

    w = np.asarray(weights)                                      # (L, H, n, n)
    n = w.shape[-1]
    if n <= max(LOCAL):
        return None
    score = local_score(w)                                       # (L, H)
    li, h = np.unravel_index(int(np.argmax(score)), score.shape)
    even = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]   # (n, n): 1/(i+1)
    base = float(offset_weight(even[None, None], LOCAL)[0, 0])
    best = float(score[li, h])
    return (int(li) + 1, int(h) + 1, best, base) if best > least else None


def with_steps(cfg: TinyConfig, steps: int) -> TinyConfig:
    """``cfg`` with another step count (the tests' shorter runs)."""
    return replace(cfg, steps=steps)
