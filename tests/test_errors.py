"""Bad input → a clear ValueError/TypeError that names what was seen and how to fix it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit import masks


def t(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, device=device)


def raises(exc: type[Exception], *fragments: str):
    """Context manager: ``exc`` whose message contains every fragment (literally)."""

    class _Ctx:
        def __enter__(self) -> None:
            self.cm = pytest.raises(exc)
            self.info = self.cm.__enter__()

        def __exit__(self, *a: object) -> bool:
            handled = self.cm.__exit__(*a)
            msg = str(self.info.value)
            for f in fragments:
                assert f in msg, f"{f!r} not in error message: {msg!r}"
            return handled

    return _Ctx()


def test_wrong_rank():
    with raises(ValueError, "q must be 2-D", "(5,)"):
        ak.attention(t(5), t(5, 4), t(5, 4))
    with raises(ValueError, "same rank", "q (2, 3, 5, 4)", "k (5, 4)", "v (5, 4)"):
        ak.attention(t(2, 3, 5, 4), t(5, 4), t(5, 4))


def test_d_k_mismatch():
    with raises(ValueError, "D_k", "q (1, 2, 5, 4)", "k (1, 2, 6, 3)", "D_k=4", "D_k=3"):
        ak.attention(t(1, 2, 5, 4), t(1, 2, 6, 3), t(1, 2, 6, 3))


def test_n_k_mismatch_between_k_and_v():
    with raises(ValueError, "N_k", "k (1, 2, 6, 4)", "v (1, 2, 7, 4)", "N_k=6", "N_k=7"):
        ak.attention(t(1, 2, 5, 4), t(1, 2, 6, 4), t(1, 2, 7, 4))


def test_heads_not_a_multiple():
    with raises(ValueError, "H_q=3", "H_kv=2", "multiple", "q (1, 3, 5, 4)", "k (1, 2, 6, 4)"):
        ak.attention(t(1, 3, 5, 4), t(1, 2, 6, 4), t(1, 2, 6, 4))
    with raises(ValueError, "H_kv", "k (1, 2, 6, 4)", "v (1, 1, 6, 4)"):
        ak.attention(t(1, 2, 5, 4), t(1, 2, 6, 4), t(1, 1, 6, 4))


def test_batch_dims_differ():
    with raises(ValueError, "leading (batch) dims", "q (2, 2, 5, 4)", "k (3, 2, 6, 4)"):
        ak.attention(t(2, 2, 5, 4), t(3, 2, 6, 4), t(3, 2, 6, 4))


def test_mixed_dtypes():
    with raises(TypeError, "one dtype", "torch.float32", "torch.float64"):
        ak.attention(t(5, 4), t(5, 4, dtype=torch.float64), t(5, 4))


def test_mixed_devices():
    with raises(ValueError, "one device", "cpu", "meta", ".to("):
        ak.attention(t(5, 4), t(5, 4, device="meta"), t(5, 4))
    with raises(ValueError, "mask is on meta", "q is on cpu"):
        ak.attention(t(5, 4), t(5, 4), t(5, 4),
                     mask=torch.ones(5, 5, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_tensors(dtype):
    with raises(TypeError, "floating-point", str(dtype), ".float()"):
        ak.attention(t(5, 4, dtype=dtype), t(5, 4, dtype=dtype), t(5, 4, dtype=dtype))


def test_integer_numpy_arrays():
    a = np.zeros((5, 4), dtype=np.int64)
    with raises(TypeError, "floating-point", "int64"):
        ak.attention(a, a, a)


@pytest.mark.parametrize("bad", [[[1.0, 2.0]], 3.0, "q", None])
def test_non_tensor_inputs(bad):
    with raises(TypeError, "q must be a torch.Tensor or a numpy.ndarray", type(bad).__name__,
                "torch.as_tensor"):
        ak.attention(bad, t(5, 4), t(5, 4))
    with raises(TypeError, "v must be"):
        ak.attention(t(5, 4), t(5, 4), bad)


@pytest.mark.parametrize("mask_shape", [(5, 7), (3, 6, 7), (2, 5, 6), (4, 1, 1, 5, 6)])
def test_mask_that_does_not_broadcast_names_both_shapes(mask_shape):
    q, k, v = t(2, 3, 5, 4), t(2, 3, 6, 4), t(2, 3, 6, 4)
    for m in (torch.ones(mask_shape, dtype=torch.bool), torch.zeros(mask_shape)):
        shown = "(" + ", ".join(map(str, mask_shape)) + ")"
        with raises(ValueError, f"mask of shape {shown}", "(2, 3, 5, 6)", "does not broadcast"):
            ak.attention(q, k, v, mask=m)


def test_mask_object_built_for_other_batch_or_heads():
    q, k, v = t(2, 3, 5, 4), t(2, 3, 6, 4), t(2, 3, 6, 4)
    with raises(ValueError, "batch 3", "batch 2", "q (2, 3, 5, 4)"):
        ak.attention(q, k, v, mask=masks.padding([1, 2, 3]))
    with raises(ValueError, "4 heads", "H_q=3"):
        ak.attention(q, k, v, mask=masks.from_tensor(torch.ones(4, 5, 6, dtype=torch.bool)))


def test_mask_of_wrong_type():
    with raises(TypeError, "mask must be", "list"):
        ak.attention(t(5, 4), t(5, 4), t(5, 4), mask=[[True] * 5] * 5)
    with raises(TypeError, "bool", "floating point", "torch.int64"):
        ak.attention(t(5, 4), t(5, 4), t(5, 4), mask=torch.zeros(5, 5, dtype=torch.long))


def test_float_mask_with_nan_or_plus_inf():
    for bad in (torch.nan, torch.inf):
        m = torch.zeros(5, 5)
        m[1, 2] = bad
        with raises(ValueError, "finite values and -inf only"):
            ak.attention(t(5, 4), t(5, 4), t(5, 4), mask=m)


def test_mask_together_with_is_causal():
    with raises(ValueError, "either mask=", "is_causal=True", "causal() &"):
        ak.attention(t(5, 4), t(5, 4), t(5, 4), mask=masks.padding([3]), is_causal=True)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_outside_range(p):
    with raises(ValueError, "dropout_p must be in [0, 1)", str(p)):
        ak.attention(t(5, 4), t(5, 4), t(5, 4), dropout_p=p)


@pytest.mark.parametrize("p", [float("nan"), float("inf"), "0.1", True])
def test_dropout_not_a_number(p):
    with raises(ValueError, "dropout_p must be a finite number"):
        ak.attention(t(5, 4), t(5, 4), t(5, 4), dropout_p=p)


def test_unknown_backend_lists_the_known_ones():
    with raises(ValueError, "unknown backend 'fastest'", "'auto'", "'reference'"):
        ak.attention(t(5, 4), t(5, 4), t(5, 4), backend="fastest")
    with raises(TypeError, "backend must be a string"):
        ak.attention(t(5, 4), t(5, 4), t(5, 4), backend=None)


@pytest.mark.parametrize("c", [0.0, -1.0])
def test_softcap_not_positive(c):
    with raises(ValueError, "softcap must be > 0", str(c)):
        ak.attention(t(5, 4), t(5, 4), t(5, 4), softcap=c)


@pytest.mark.parametrize("s", [float("nan"), float("inf"), "0.5"])
def test_scale_not_a_finite_number(s):
    with raises(ValueError, "scale must be a finite number"):
        ak.attention(t(5, 4), t(5, 4), t(5, 4), scale=s)


def test_score_mod_not_callable():
    with raises(TypeError, "score_mod must be a function", "int"):
        ak.attention(t(5, 4), t(5, 4), t(5, 4), score_mod=3)


def test_errors_come_before_any_work():
    """Validation happens in prepare(): the same errors come from explain()."""
    with raises(ValueError, "D_k"):
        ak.explain(t(5, 4), t(5, 3), t(5, 3))
    with raises(ValueError, "either mask="):
        ak.explain(t(5, 4), t(5, 4), t(5, 4), mask=torch.ones(5, 5, dtype=torch.bool),
                   is_causal=True)


def test_forced_backend_that_cannot_run_gives_reasons():
    class Never(ak.backends.Backend):
        name = "never_test_backend"

        def not_supported_reasons(self, p):  # noqa: ANN001, ANN201
            return [f"never runs (got N_q={p.n_q})"]

    ak.backends.register(Never())
    try:
        with raises(ValueError, "backend 'never_test_backend' cannot run",
                    "never runs (got N_q=5)", "backend='auto'"):
            ak.attention(t(5, 4), t(5, 4), t(5, 4), backend="never_test_backend")
        # "auto" skips it and still answers
        assert ak.attention(t(5, 4), t(5, 4), t(5, 4)).shape == (5, 4)
    finally:
        ak.backends.REGISTRY.pop("never_test_backend")
        ak.backends.PRIORITY.remove("never_test_backend")


def test_no_backend_fits_lists_every_reason():
    saved = dict(ak.backends.REGISTRY), list(ak.backends.PRIORITY)

    class Never(ak.backends.Backend):
        name = "never_a"

        def not_supported_reasons(self, p):  # noqa: ANN001, ANN201
            return ["reason A"]

    try:
        ak.backends.REGISTRY.clear()
        ak.backends.PRIORITY.clear()
        ak.backends.register(Never())
        with raises(ValueError, "no backend can run this call", "never_a: reason A"):
            ak.attention(t(5, 4), t(5, 4), t(5, 4))
    finally:
        ak.backends.REGISTRY.clear()
        ak.backends.REGISTRY.update(saved[0])
        ak.backends.PRIORITY[:] = saved[1]


def test_mask_error_for_two_d_inputs_speaks_two_d():
    with raises(ValueError, "mask of shape (5, 6)", "(N_q, N_k) = (5, 5)"):
        ak.attention(t(5, 4), t(5, 4), t(5, 4), mask=torch.ones(5, 6, dtype=torch.bool))


def test_mixing_torch_and_numpy_is_refused():
    q = torch.randn(3, 4, requires_grad=True)
    k = np.random.rand(5, 4).astype(np.float32)
    with pytest.raises(TypeError, match=r"all torch tensors or all NumPy arrays.*q torch, k NumPy"):
        ak.attention(q, k, k)


def test_integer_numpy_gets_a_numpy_hint():
    x = np.ones((3, 4), dtype=np.int64)
    with pytest.raises(TypeError, match=r"astype\(np.float32\)"):
        ak.attention(x, x, x)
