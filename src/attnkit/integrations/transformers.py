"""attnkit as an attention implementation for Hugging Face transformers.

One call registers :func:`attnkit.attention` with transformers' attention interface (and
its mask interface, so models build the masks attnkit reads); then any model whose
attention layers dispatch through ``ALL_ATTENTION_FUNCTIONS`` runs every layer through
attnkit::

    import attnkit.integrations.transformers as akt
    akt.register()                                         # name="attnkit"
    model = AutoModel.from_pretrained(path, attn_implementation="attnkit")
    model.set_attn_implementation("attnkit")               # or switch a loaded model

Shape legend (what transformers hands an attention function, and what it gets back)::

    query            (B, H_q,  N_q, D)
    key              (B, H_kv, N_k, D)      H_q = G · H_kv (GQA: G = num_key_value_groups);
    value            (B, H_kv, N_k, D_v)    K/V are passed on as they are — never repeated
    attention_mask   None, or 4-D (B|1, 1|H_q, N_q, N_k):
                       bool  — True = may attend (what the registered mask builder makes)
                       float — added to the logits; -inf or ≤ finfo(dtype).min / 2 = blocked
    position_bias    float (B|1, H_q|1, N_q, N_k), added to the logits (T5-style models)
    → out            (B, N_q, H_q, D_v)     contiguous (the caller reshapes to (B, N_q, H_q·D_v))
    → weights        None, or (B, H_q, N_q, N_k) with ``output_attentions=True``

How the arguments are translated:

- ``scaling`` → ``scale`` (``None``: 1/√D); ``dropout`` → ``dropout_p`` (transformers already
  passes 0.0 in eval mode); ``softcap`` → ``softcap`` (same order: after scaling, before the
  mask).
- Causality: with a mask, the mask is the whole truth (as in torch SDPA). Without one, the
  ``is_causal`` keyword decides, else ``module.is_causal`` (default True) — and, exactly as
  transformers' SDPA path does, a single query (``N_q == 1``, decoding) is never causally
  masked, because it is the newest token and may see every cached key.
- ``sliding_window``: transformers' mask builders already put the window into the mask, so
  with a mask it is not applied twice. Without a mask it becomes
  :func:`attnkit.masks.sliding_window` (causal: ``kv > q − w``; bidirectional: ``|q − kv| ≤ w``).
- ``output_attentions=True``: the weights are computed a second time by attnkit's
  reference (the textbook softmax, which materialises them: O(N_q·N_k) memory per layer and
  slower than the fused path; the output itself still comes from the fast backend). They are
  the weights before dropout, in the query's dtype.
- Bookkeeping keywords the caller has already used (``position_ids``, ``use_cache``,
  ``cache_position``, ``encoder_hidden_states``, packed-sequence lengths, ...) are ignored,
  as transformers' own SDPA function ignores them.

Building attnkit layers from a transformers model (no attention function involved)::

    rope = rope_from_config(model.config)                 # an attnkit.rope.RoPE
    layer = attention_from_llama(model.model.layers[0].self_attn)   # ak.MultiHeadAttention
    out = layer(x, cache=ak.KVCache(), is_causal=True)    # = LlamaAttention's output

``rope_from_config`` reads ``rope_parameters`` (``rope_type`` "default", "linear" and
"llama3"; ``rope_theta``; ``partial_rotary_factor``); other rope types are refused with
:class:`UnsupportedFeatureError`. ``attention_from_llama`` fits Llama-style attention
(q/k/v/o projections, GQA, optional biases, RoPE; tested on Llama); layers with extra
parts (QK-norm, sinks) are refused.

Caution
-------
- Float masks: transformers' eager masks block with ``torch.finfo(dtype).min`` (a large
  finite number, not −∞). attnkit treats every value ≤ ``finfo(mask.dtype).min / 2`` (and −∞)
  as *blocked*, and every other value as an additive bias. No real bias comes near half the
  dtype's range, and reading those entries as blocked lets attnkit skip them (and avoids
  overflow in float16). The one visible difference from eager: a query with *no* allowed key
  gets output 0 here, where eager averages all values uniformly. Only padding queries have
  such rows, and models never read their outputs.
- Not supported yet, and refused with :class:`UnsupportedFeatureError` naming the feature,
  rather than silently computed wrong: ``head_mask``, attention sinks (``s_aux`` /
  ``sinks``), flex ``BlockMask`` masks, and any other keyword attnkit does not know (pass
  ``ignore_kwargs=`` to :func:`register` for a keyword you know to be bookkeeping).
- ``output_attentions=True``: for a query with no allowed key (a padding query) the
  weights are all 0, where eager's are uniform (see the float-mask note above).
- Tested against transformers 5.x (BERT/MiniLM and Llama, with a KV cache); models that
  build their own masks without the mask interface are untested.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

try:
    import transformers as _hf
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
except ImportError as _e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "attnkit.integrations.transformers needs Hugging Face transformers (>= 5.0), which is "
        f"not importable here ({_e}). Install it with: pip install \"attnkit[transformers]\""
    ) from _e

from .. import _compat
from .. import backends as _backends
from .. import masks as _masks
from ..api import attention as _attention
from ..layers.mha import MultiHeadAttention
from ..layers.rope import LinearScaling, Llama3Scaling, RoPE
from ..layers.shared import attention_weights as _attention_weights

__all__ = [
    "register",
    "make_attention_function",
    "rope_from_config",
    "attention_from_llama",
    "convert_mask",
    "UnsupportedFeatureError",
    "IGNORED_KWARGS",
    "UNSUPPORTED_KWARGS",
]

TRANSFORMERS_VERSION: str = _hf.__version__

# Keywords transformers forwards to every attention function that carry no work for it:
# the caller has already used them (positions, cache) or they are encoded in the mask.
IGNORED_KWARGS: frozenset[str] = frozenset({
    "position_ids", "cache_position", "use_cache", "past_key_values", "past_key_value", "cache",
    "layer_idx", "output_hidden_states", "output_router_logits", "return_dict",
    "num_items_in_batch", "encoder_hidden_states", "encoder_attention_mask", "token_type_ids",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
    "position_embeddings",
})

# Keywords naming features attnkit does not provide yet → why, and what to do instead.
UNSUPPORTED_KWARGS: dict[str, str] = {
    "head_mask": "head_mask (scaling each head's weights) is not supported: mask the heads' "
                 "outputs instead, or use attn_implementation='eager'",
    "s_aux": "attention sinks (s_aux: a learned per-head logit in the softmax denominator) "
             "are not supported yet: use attn_implementation='eager'",
    "sinks": "attention sinks (a learned per-head logit in the softmax denominator) are not "
             "supported yet: use attn_implementation='eager'",
}

# transformers' own implementations (snapshot before any registration of ours).
_BUILTIN_NAMES: frozenset[str] = _compat.hf_builtin_attention_names()
_OURS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = {}


class UnsupportedFeatureError(NotImplementedError):
    """A model asked attnkit for something it cannot honour (the message names the feature)."""


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _absent(x: Any) -> bool:
    return x is None or x is False


def convert_mask(attention_mask: Any) -> torch.Tensor | None:
    """transformers' 4-D attention mask → what :func:`attnkit.attention` reads.

    Shapes: ``attention_mask`` ``(B|1, H|1, N_q, N_k)`` → the same shape, as

    - ``None`` → ``None``;
    - bool (True = may attend) → unchanged;
    - float: entries ≤ ``finfo(dtype).min / 2`` or −∞ are *blocked*; if every other entry is
      0 the result is the bool mask "not blocked", otherwise a float mask holding the other
      entries as additive bias and −∞ where blocked.

    Raises ``TypeError`` for other types (e.g. a flex ``BlockMask``) or integer dtypes, and
    ``ValueError`` for a tensor that is not 4-D.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attnkit received an attention mask of type {type(attention_mask).__name__}; it reads "
            "4-D bool or float tensors. A flex_attention BlockMask means the model built its "
            "mask for another implementation: load it with attn_implementation='attnkit' (after "
            "attnkit.integrations.transformers.register()) so transformers builds a tensor mask"
        )
    if attention_mask.dim() != 4:
        raise ValueError(
            f"attnkit expects transformers' 4-D attention mask (B, 1|H, N_q, N_k), got shape "
            f"{_shape(attention_mask)}: pass the 2-D padding mask to the model, not to the "
            "attention function"
        )
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if not attention_mask.dtype.is_floating_point:
        raise TypeError(
            f"attention mask has dtype {attention_mask.dtype}; attnkit reads bool (True = may "
            "attend) or float (added to the logits) masks: convert with mask.bool()"
        )
    blocked = attention_mask <= torch.finfo(attention_mask.dtype).min / 2      # −∞ included
    if not bool(blocked.any()):
        return attention_mask
    rest = attention_mask.masked_fill(blocked, 0.0)
    if not bool(rest.any()):
        return ~blocked                                  # a pure pattern: cheaper as bool
    return attention_mask.masked_fill(blocked, -torch.inf)


def _check_kwargs(kwargs: dict[str, Any], ignore: frozenset[str]) -> None:
    for key, val in kwargs.items():
        if key in UNSUPPORTED_KWARGS:
            if not _absent(val):
                raise UnsupportedFeatureError(f"attnkit (transformers): {UNSUPPORTED_KWARGS[key]}")
        elif key not in IGNORED_KWARGS and key not in ignore and not _absent(val):
            raise UnsupportedFeatureError(
                f"attnkit (transformers): the model passed {key}={_describe(val)} to the "
                f"attention function, and attnkit does not know how to honour {key!r}. If it "
                "is bookkeeping that attention does not need, register with "
                f"register(..., ignore_kwargs=[{key!r}]); otherwise use "
                "attn_implementation='eager' for this model"
            )


def _describe(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"<tensor {_shape(val)} {val.dtype}>"
    text = repr(val)
    return text if len(text) <= 40 else text[:37] + "..."


def _window_mask(window: int, causal: bool, n_q: int) -> _masks.Mask:
    if causal:
        # N_q > 1 with no mask: keys start at position 0 (top-left); one query is the newest.
        align = "top_left" if n_q > 1 else "bottom_right"
        return _masks.sliding_window(window, causal=True, align=align)
    return _masks.sliding_window(window + 1, causal=False)


def make_attention_function(
    *, backend: str = "auto", ignore_kwargs: Iterable[str] = ()
) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """Build the function transformers calls for every attention layer.

    The returned ``fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
    is_causal=None, softcap=None, sliding_window=None, position_bias=None, **kwargs)``
    returns ``(out (B, N_q, H_q, D_v), None)`` — or ``(out, weights (B, H_q, N_q, N_k))``
    when called with ``output_attentions=True`` (the weights by the reference: slower, see
    the module docstring); see the module docstring for the shapes and the translation.
    ``backend`` is passed to :func:`attnkit.attention`; keywords named in ``ignore_kwargs``
    are accepted and ignored.
    """
    _backends.check_name(backend, what="attnkit backend")
    ignore = frozenset(ignore_kwargs)

    def attnkit_attention_forward(
        module: torch.nn.Module | None,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        softcap: float | None = None,
        sliding_window: int | None = None,
        position_bias: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        want_weights = not _absent(kwargs.pop("output_attentions", None))
        _check_kwargs(kwargs, ignore)
        if query.dim() != 4:
            raise ValueError(
                f"attnkit expects transformers' query layout (B, H_q, N_q, D), got query "
                f"{_shape(query)}"
            )
        n_q, n_k = query.shape[2], key.shape[2]
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        mask: Any = convert_mask(attention_mask)
        if mask is None:
            structured: _masks.Mask | None = None
            if causal and n_q > 1:
                structured = _masks.causal()
            if sliding_window is not None and sliding_window > 0:
                win = _window_mask(int(sliding_window), bool(causal), n_q)
                structured = win if structured is None else structured & win
            mask = structured
        if position_bias is not None:
            mask = _with_bias(mask, position_bias, n_q, n_k)
        out = _attention(query, key, value, mask=mask, scale=scaling, softcap=softcap,
                         dropout_p=float(dropout or 0.0), backend=backend)
        weights = _attention_weights(query, key, value, mask=mask, scale=scaling,
                                     softcap=softcap) if want_weights else None
        return out.transpose(1, 2).contiguous(), weights    # (B, N_q, H_q, D_v), (B, H_q, …)

    return attnkit_attention_forward


def _with_bias(mask: Any, bias: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    """Fold an additive position bias into one float mask (−∞ where blocked)."""
    if isinstance(mask, _masks.Mask):
        mask = mask.to_dense(n_q, n_k, device=bias.device)
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, torch.tensor(-torch.inf, dtype=bias.dtype,
                                                     device=bias.device))
    return bias + mask


def register(
    name: str = "attnkit", *, backend: str = "auto", ignore_kwargs: Iterable[str] = ()
) -> str:
    """Register attnkit with transformers under ``name`` and return the name.

    Afterwards ``AutoModel.from_pretrained(path, attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) runs every attention layer through
    :func:`attnkit.attention`. Registers both the attention function and the mask builder
    (bool masks, True = may attend; ``None`` where a plain causal/full pattern needs none).

    Args:
        name: the implementation name; must not be one of transformers' own
            (``"eager"``, ``"sdpa"``, ``"flash_attention_2"``, ...). Registering the same name
            again replaces the earlier registration (e.g. to change ``backend``).
        backend: the attnkit backend every call uses (``"auto"`` picks the fastest that fits).
        ignore_kwargs: extra keyword names to accept and ignore (bookkeeping your model
            passes that attention does not need).
    """
    if not isinstance(name, str) or not name or name.strip() != name:
        raise ValueError(
            f"name must be a non-empty string without surrounding spaces, got {name!r}")
    if name in _BUILTIN_NAMES and name not in _OURS:
        raise ValueError(
            f"{name!r} is one of transformers' own attention implementations; registering "
            "attnkit under it would replace it for every model in this process. Pick another "
            "name, e.g. register('attnkit')"
        )
    fn = make_attention_function(backend=backend, ignore_kwargs=ignore_kwargs)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    _OURS[name] = fn
    return name


# ------------------------------------------------------------------ layers from a model
def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_from_config(config: Any, *, layer_type: str | None = None) -> RoPE:
    """The :class:`attnkit.rope.RoPE` a transformers model config describes.

    Reads ``config.rope_parameters`` (transformers 5; per-layer-type dicts need
    ``layer_type``, e.g. ``"full_attention"``) or the older ``rope_theta`` / ``rope_scaling``
    attributes: ``rope_type`` "default", "linear" (→ :class:`~attnkit.rope.LinearScaling`) and
    "llama3" (→ :class:`~attnkit.rope.Llama3Scaling`); ``partial_rotary_factor`` → ``dims``.
    Always the "half" style (transformers' ``rotate_half``). Other rope types raise
    :class:`UnsupportedFeatureError` naming the type.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if layer_type is not None:
        if layer_type not in params:
            raise ValueError(f"the config has no rope parameters for layer_type={layer_type!r}"
                             f"; it has {sorted(params)}")
        params = params[layer_type]
    elif params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"this config has rope parameters per layer type {sorted(params)}: "
                         "pass layer_type=... (one of them)")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    head_dim = _head_dim(config)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    dims = int(head_dim * factor) if factor != 1.0 else None
    scaling: LinearScaling | Llama3Scaling | None
    if kind == "default":
        scaling = None
    elif kind == "linear":
        scaling = LinearScaling(float(params["factor"]))
    elif kind == "llama3":
        scaling = Llama3Scaling(
            factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]))
    else:
        raise UnsupportedFeatureError(
            f"attnkit (transformers): rope_type={kind!r} is not supported by attnkit.rope yet "
            "(it has 'default', 'linear' and 'llama3'): keep transformers' own rotary "
            "embedding for this model"
        )
    return RoPE(theta=theta, dims=dims, style="half", scaling=scaling)


def attention_from_llama(attn: torch.nn.Module, config: Any = None) -> MultiHeadAttention:
    """An :class:`attnkit.MultiHeadAttention` with the same weights and rotary embedding as
    a Llama-style transformers attention module ``attn`` (``q_proj``, ``k_proj``,
    ``v_proj``, ``o_proj``; GQA; biases where the model has them).

    ``config`` defaults to ``attn.config``. Call the result with ``is_causal=True`` (and a
    :class:`attnkit.KVCache` when decoding): it equals ``LlamaAttention`` with a causal mask
    and the model's ``position_embeddings``. Same dtype, device and training mode as ``attn``.
    """
    config = getattr(attn, "config", None) if config is None else config
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if config is None or not all(isinstance(getattr(attn, n, None), torch.nn.Linear)
                                 for n in names):
        raise TypeError(
            f"attention_from_llama needs a Llama-style attention module with nn.Linear "
            f"{', '.join(names)} and a config (attn.config or config=...), got "
            f"{type(attn).__name__}"
        )
    extra = [n for n in ("q_norm", "k_norm", "sinks") if getattr(attn, n, None) is not None]
    if extra:
        raise UnsupportedFeatureError(
            f"attnkit (transformers): {type(attn).__name__} has {', '.join(extra)}, which "
            "attention_from_llama does not convert (it builds plain Llama-style attention)"
        )
    head_dim = _head_dim(config)
    projs = [getattr(attn, n) for n in names]
    has_bias = any(p.bias is not None for p in projs)
    layer = MultiHeadAttention(
        config.hidden_size, config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
        head_dim=head_dim, bias=has_bias, dropout=float(getattr(config, "attention_dropout", 0.0)),
        rope=rope_from_config(config),
    )
    w = attn.q_proj.weight
    layer.to(device=w.device, dtype=w.dtype)
    scaling = getattr(attn, "scaling", None)
    if scaling is not None:
        layer.scale = float(scaling)
    with torch.no_grad():
        for mine, theirs in zip((layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj),
                                projs, strict=True):
            if mine.weight.shape != theirs.weight.shape:
                raise ValueError(
                    f"{type(attn).__name__}'s projection weight {_shape(theirs.weight)} does "
                    f"not match the config's shape {_shape(mine.weight)}: pass the model's "
                    "own config"
                )
            mine.weight.copy_(theirs.weight)
            if mine.bias is not None:
                mine.bias.copy_(theirs.bias if theirs.bias is not None else 0.0)
    layer.train(attn.training)
    return layer
