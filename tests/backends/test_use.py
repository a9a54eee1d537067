"""``attnkit.backends.use``: a scoped backend choice, as ``torch.nn.attention.sdpa_kernel``.

Which backend ran a call is seen by wrapping each backend's entry points
(``helpers.running.spy_on_backend``: undone by monkeypatch afterwards).

Shape legend: q (B, H_q, N_q, D), k / v (B, H_kv, N_k, D).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

import attnkit as ak
from attnkit import backends
from attnkit.api import prepare
from helpers.running import spy_on_backend


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """(thread name, backend name) of every backend forward, in call order."""
    seen: list[tuple[str, str]] = []
    for name in backends.names():
        spy_on_backend(monkeypatch, backends.get(name),
                       lambda p, name=name: seen.append((threading.current_thread().name, name)))
    yield seen


def _decode_qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(1, 4, 1, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)


def _names(seen: list[tuple[str, str]]) -> list[str]:
    return [n for _, n in seen]


# ============================================================ choosing
def test_one_name_runs_every_auto_call_on_it(ran):
    q, k, v = _decode_qkv()
    with torch.no_grad():
        want = ak.attention(q, k, v)
        assert _names(ran) == ["decode"]
        with backends.use("tiled") as chosen:
            assert chosen == ("tiled",) and backends.current() == ("tiled",)
            got = ak.attention(q, k, v)
            sdpa = ak.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert backends.current() is None
        ak.attention(q, k, v)
    assert _names(ran) == ["decode", "tiled", "tiled", "decode"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sdpa, want, rtol=1e-5, atol=1e-6)


def test_a_list_is_auto_among_those_names_in_that_order(ran):
    q, k, v = _decode_qkv()
    with backends.use(["reference", "decode"]), torch.no_grad():
        ak.attention(q, k, v)                           # both can: the first listed runs
    with backends.use(["decode", "reference"]):
        with torch.no_grad():
            ak.attention(q, k, v)                       # decode first now
        ak.attention(q.requires_grad_(), k, v)          # decode refuses grad: the next one
    assert _names(ran) == ["reference", "decode", "reference"]


def test_an_explicit_backend_argument_wins_over_the_scope(ran):
    q, k, v = _decode_qkv()
    with backends.use("reference"), torch.no_grad():
        ak.attention(q, k, v, backend="tiled")
        ak.attention(q, k, v, backend="auto")           # auto means the scope
    assert _names(ran) == ["tiled", "reference"]


def test_auto_inside_a_scope_is_every_backend_again(ran):
    q, k, v = _decode_qkv()
    with backends.use("reference"), torch.no_grad():
        with backends.use("auto") as chosen:
            assert chosen == () and backends.current() is None
            ak.attention(q, k, v)
        ak.attention(q, k, v)
    assert _names(ran) == ["decode", "reference"]


def test_nested_scopes_the_innermost_wins_and_each_exit_restores(ran):
    q, k, v = _decode_qkv()
    with torch.no_grad(), backends.use("reference"):
        with backends.use("tiled"):
            with backends.use("decode"):
                ak.attention(q, k, v)
            ak.attention(q, k, v)
        ak.attention(q, k, v)
    ak.attention(q, k, v)                               # (grad enabled, no grad needed)
    assert _names(ran) == ["decode", "tiled", "reference", "decode"]


def test_an_exception_inside_restores_the_previous_choice():
    with backends.use("tiled"):
        with pytest.raises(RuntimeError, match="boom"), backends.use("reference"):
            assert backends.current() == ("reference",)
            raise RuntimeError("boom")
        assert backends.current() == ("tiled",)
        q, k, v = _decode_qkv()
        with pytest.raises(ValueError, match="backend 'decode' cannot run"), \
                backends.use("decode"):
            ak.attention(q.requires_grad_(), k, v)      # refused inside the inner scope
        assert backends.current() == ("tiled",)
    assert backends.current() is None


def test_usable_as_a_decorator(ran):
    @backends.use("reference")
    def f(q, k, v):  # noqa: ANN001, ANN202
        return ak.attention(q, k, v)

    q, k, v = _decode_qkv()
    with torch.no_grad():
        f(q, k, v)
        f(q, k, v)
        ak.attention(q, k, v)
    assert _names(ran) == ["reference", "reference", "decode"]


# ============================================================ errors
def test_unknown_names_and_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match=r"unknown backend 'nope': choose one of 'auto', "
                                         r"'reference'"):
        backends.use("nope")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        backends.use(["tiled", "nope"])
    with pytest.raises(TypeError, match="a backend name or a list of names"):
        backends.use(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backend must be a string"):
        backends.use(["tiled", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one backend name"):
        backends.use([])
    with pytest.raises(ValueError, match="'auto' stands alone"):
        backends.use(["auto", "tiled"])
    with pytest.raises(ValueError, match="got a name twice"):
        backends.use(["tiled", "tiled"])
    assert backends.current() is None


def test_a_chosen_backend_that_cannot_run_raises_the_explicit_backends_error():
    q, k, v = _decode_qkv()
    q.requires_grad_()
    with pytest.raises(ValueError) as explicit:
        ak.attention(q, k, v, backend="decode")
    with backends.use("decode"), pytest.raises(ValueError) as scoped:
        ak.attention(q, k, v)
    # the same reasons and the same description of the call; only the way out differs
    assert str(scoped.value).splitlines()[:2] == str(explicit.value).splitlines()[:2]
    assert "forward only (inputs require grad)" in str(scoped.value)
    assert "attnkit.backends.use('decode')" in str(scoped.value).splitlines()[-1]


def test_a_list_none_of_which_can_run_lists_each_ones_reasons():
    q, k, v = _decode_qkv()
    p = prepare(q.requires_grad_(), k, v, dropout_p=0.5).problem
    with backends.use(["decode", "triton"]), pytest.raises(ValueError) as e:
        backends.select(p)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("no backend of attnkit.backends.use(['decode', 'triton'])")
    assert [ln.split(":")[0].strip() for ln in lines[1:]] == ["decode", "triton"]
    assert "forward only" in lines[1] and "no dropout" in lines[1]


# ============================================================ context safety
def test_threads_each_have_their_own_choice(ran):
    """Two threads inside different scopes at the same time, and a thread started inside a
    scope (which starts without it): each call runs where its own context says."""
    q, k, v = _decode_qkv()
    both_inside = threading.Barrier(2)
    errors: list[BaseException] = []

    def work(name: str | None) -> None:
        try:
            with torch.no_grad():
                if name is None:
                    both_inside.wait(timeout=30)
                    ak.attention(q, k, v)
                    both_inside.wait(timeout=30)
                    return
                with backends.use(name):
                    both_inside.wait(timeout=30)         # both threads inside now
                    for _ in range(3):
                        ak.attention(q, k, v)
                    both_inside.wait(timeout=30)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with backends.use("reference"):
        threads = [threading.Thread(target=work, args=("tiled",), name="T-tiled"),
                   threading.Thread(target=work, args=(None,), name="T-none")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        with torch.no_grad():
            ak.attention(q, k, v)                        # this thread: still reference
    assert not errors, errors
    by_thread: dict[str, list[str]] = {}
    for thread, name in ran:
        by_thread.setdefault(thread, []).append(name)
    assert by_thread["T-tiled"] == ["tiled"] * 3
    assert by_thread["T-none"] == ["decode"]             # a new thread: no scope
    assert by_thread[threading.current_thread().name] == ["reference"]


def test_asyncio_tasks_each_have_their_own_choice_and_inherit_their_creators(ran):
    q, k, v = _decode_qkv()

    async def call(name: str | None, steps: int) -> list[tuple[str, ...] | None]:
        seen = []
        if name is None:
            for _ in range(steps):
                ak.attention(q, k, v)
                seen.append(backends.current())
                await asyncio.sleep(0)
            return seen
        with backends.use(name):
            for _ in range(steps):
                ak.attention(q, k, v)                   # interleaved with the other task
                seen.append(backends.current())
                await asyncio.sleep(0)
        return seen

    async def main() -> tuple:
        a = asyncio.create_task(call("tiled", 3))
        b = asyncio.create_task(call("reference", 3))
        with backends.use("reference"):
            c = asyncio.create_task(call(None, 2))      # created inside: inherits it
        d = asyncio.create_task(call(None, 1))          # created outside: none
        return await asyncio.gather(a, b, c, d)

    with torch.no_grad():
        a, b, c, d = asyncio.run(main())
    assert a == [("tiled",)] * 3 and b == [("reference",)] * 3
    assert c == [("reference",)] * 2 and d == [None]
    assert sorted(_names(ran)) == sorted(["tiled"] * 3 + ["reference"] * 5 + ["decode"])
    assert backends.current() is None


# ============================================================ layers, compile
def test_a_layer_inside_a_scope(ran):
    torch.manual_seed(0)
    layer = ak.MultiHeadAttention(16, 4, n_kv_heads=2).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = layer(x, is_causal=True)
        n_auto = len(ran)
        with backends.use("reference"):
            got = layer(x, is_causal=True)
            cache = ak.KVCache()
            layer(x[:, :4], cache=cache, is_causal=True)
            layer(x[:, 4:], cache=cache, is_causal=True)   # one decoding step
    assert _names(ran)[n_auto:] == ["reference"] * 3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_under_torch_compile_the_scope_at_run_time_chooses(ran):
    """The compiled graph holds attnkit's operator with backend "auto"; its implementation
    runs eagerly when the graph runs, inside the caller's scope (fullgraph holds)."""
    q, k, v = _decode_qkv()

    def f(q, k, v):  # noqa: ANN001, ANN202
        return ak.attention(q, k, v)

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    with torch.no_grad():
        want = ak.attention(q, k, v)
        n0 = len(ran)
        with backends.use("reference"):
            got = compiled(q, k, v)
        compiled(q, k, v)
    assert _names(ran)[n0:] == ["reference", "decode"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
