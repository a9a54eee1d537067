"""The private PyTorch and transformers APIs attnkit relies on, reached from here only.

Each name below is a private (underscore) API of the pinned torch 2.13 or transformers that
has no public equivalent with the same behaviour. Keeping them in one module means a torch
upgrade that moves or changes one breaks one file, and ``tests/test_compat.py`` checks each
against the installed version (its schema, its behaviour) so that such a change fails loudly
there rather than as a wrong answer somewhere else.

- :data:`flash_cpu`, :data:`flash_cpu_backward`: torch's CPU flash-attention operators
  ``aten::_scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``), which return
  the LSE that SDPA's public function drops; the tiled engine merges key runs by it.
  Layout ``q (B, H, N_q, D)``, ``k, v (B, H, N_k, D)`` → ``out (B, H, N_q, D)``,
  ``lse (B, H, N_q)`` float32.
- :func:`tree_flatten`, :func:`tree_leaves`: ``torch.utils._pytree`` (the score_mod tracer
  walks the arguments of every torch function it records).
- :data:`torch_function_disabled`: ``torch._C.DisableTorchFunction`` (read a tensor's bytes
  from inside a ``__torch_function__`` mode without recording the read).
- :func:`hf_builtin_attention_names`: the names of transformers' own attention
  implementations, ``AttentionInterface._global_mapping`` (so registering ``"attnkit"`` never
  shadows ``"sdpa"``); transformers is optional and imported only when asked.
- :func:`compiling`: ``torch.compiler.is_compiling()``'s answer in one function, reading
  ``torch.compiler._is_compiling_flag`` (which torch.compile's session and torch.export hold
  True) after ``is_dynamo_compiling()`` (True while Dynamo traces); ``is_compiling`` itself
  is two Python functions (it asks ``torch.jit.is_scripting`` first), microseconds each on
  a cold per-token call. Where this torch lacks either piece: ``is_compiling`` itself.
- :data:`jit_tracing_state`: ``torch._C._get_tracing_state`` (None unless ``torch.jit.trace``
  is recording): the per-token call's hot frame stays out of a TorchScript trace.
- :func:`run_outside_graph`: ``torch._disable_dynamo``, ``torch.compiler.disable`` with the
  import of ``torch._dynamo`` put off to the decorated function's first call. The public
  decorator imports Dynamo at once, and that import is most of ``import attnkit``'s time
  (~2.5 s of ~2.9 s on a 2-core machine) though only a compiling user ever needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as _pytree

__all__ = ["flash_cpu", "flash_cpu_backward", "tree_flatten", "tree_leaves",
           "torch_function_disabled", "hf_builtin_attention_names", "run_outside_graph",
           "compiling", "jit_tracing_state"]

flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """``(leaves, spec)`` of a nested structure of tuples, lists and dicts (torch's pytree)."""
    return _pytree.tree_flatten(tree)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a nested structure (torch's pytree), in flatten order."""
    return _pytree.tree_leaves(tree)


# ``with torch_function_disabled():`` tensor methods called inside skip every
# ``__torch_function__`` override and mode (a class, used as a context manager).
torch_function_disabled = torch._C.DisableTorchFunction


_compiler = torch.compiler
_dynamo_compiling = getattr(_compiler, "is_dynamo_compiling", None)
FLAG_READ = (_dynamo_compiling is not None
             and type(getattr(_compiler, "_is_compiling_flag", None)) is bool
             and "_is_compiling_flag" in getattr(getattr(_compiler.is_compiling, "__code__",
                                                         None), "co_names", ()))


def _compiling() -> bool:
    return _dynamo_compiling() or _compiler._is_compiling_flag  # type: ignore[misc,return-value]


# torch.compile / torch.export tracing: True (what torch.compiler.is_compiling() says)
compiling: Callable[[], bool] = _compiling if FLAG_READ else _compiler.is_compiling

# None unless torch.jit.trace is recording (a C function: one call)
jit_tracing_state = torch._C._get_tracing_state

# How many TorchDispatchModes are on the stack, and whether one of them is a tracer's —
# make_fx's proxy mode, FakeTensorMode, FunctionalTensorMode (torch's "infra" modes, which
# record operators or run them on tensors without data) — or a torch.func transform (grad,
# vmap, jacrev …) is running: while a tracer or a transform is on, a call must be made of
# operators it knows — attnkit::attention (with its fake and autograd rules) or plain torch —
# not the native kernel's, which it would record as garbage or reject. A mode of the user's
# (a recorder, FlopCounterMode) runs the operators on real tensors: the call runs as eager.
# (C functions, ~30-100 ns each.)
dispatch_modes = torch._C._len_torch_dispatch_stack
func_transforms: Callable[[], bool] = getattr(torch._C, "_are_functorch_transforms_active",
                                              lambda: False)
_get_mode = torch._C._get_dispatch_mode
_TRACER_KEYS = tuple(getattr(torch._C._TorchDispatchModeKey, name)
                     for name in ("PROXY", "FAKE", "FUNCTIONAL")
                     if hasattr(torch._C._TorchDispatchModeKey, name))
_PYTHON_KEY = torch._C.DispatchKey.Python


def tracer_mode() -> bool:
    """Whether make_fx's proxy mode, FakeTensorMode or FunctionalTensorMode is on."""
    return any(_get_mode(key) is not None for key in _TRACER_KEYS)


def intercepted(*tensors: Any) -> bool:
    """Whether a tracer's dispatch mode or a torch.func transform is on (see
    :data:`dispatch_modes`), or one of ``tensors`` is a tensor subclass that handles its
    operators in Python (``__torch_dispatch__``: FakeTensor, DTensor, a user's subclass; not
    ``nn.Parameter``)."""
    if (dispatch_modes() and tracer_mode()) or func_transforms():
        return True
    return any(type(t) is not torch.Tensor and isinstance(t, torch.Tensor)
               and torch._C._dispatch_keys(t).has(_PYTHON_KEY) for t in tensors)


_functorch = torch._C._functorch
_TRANSFORMS = getattr(_functorch, "TransformType", None)
_NOT_DIFFERENTIATING = {getattr(_TRANSFORMS, name, None) for name in ("Vmap", "Functionalize")}


def differentiating() -> bool:
    """Whether a torch.func transform that differentiates (grad, vjp, jacrev, jvp, hessian …)
    is running: it cannot go through torch.library's or an autograd.Function's backward
    unless they define functorch rules, so the call must be plain torch operators. (vmap
    alone and functionalize take the attnkit::attention operator.)"""
    stack = getattr(_functorch, "get_interpreter_stack", lambda: None)() or ()
    return any(i.key() not in _NOT_DIFFERENTIATING for i in stack)


def run_outside_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly, outside any graph torch.compile / torch.export is tracing (a graph
    break), as ``torch.compiler.disable(fn)`` does, without importing Dynamo before the call."""
    return torch._disable_dynamo(fn)


def hf_builtin_attention_names() -> frozenset[str]:
    """The attention implementations transformers registers itself (``"sdpa"``, flash …),
    plus ``"eager"`` (its plain path, which is not in the mapping)."""
    from transformers import AttentionInterface

    return frozenset(AttentionInterface._global_mapping) | {"eager"}
