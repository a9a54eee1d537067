"""The cost model: closed-form formulas recomputed here, the table, and the CLI entry point."""

from __future__ import annotations

import json

import pytest
import torch

import attnkit as ak
from attnkit.cost import report, run_cli


@pytest.mark.parametrize("d, H, n, kv, d_c, m, batch, b", [
    (4096, 32, 8192, 8, 512, 4, 1, 2),
    (768, 12, 1024, 4, 96, 4, 3, 4),
    (64, 8, 7, 2, 16, 3, 2, 1),
])
def test_formulas_match_closed_form(d, H, n, kv, d_c, m, batch, b):
    r = report(d, H, n, n_kv_heads=kv, kv_latent_dim=d_c, ffn_mult=m, batch=batch,
               dtype_bytes=b)
    h = d // H
    # parameters (the course: attention 4d², FFN d→4d→d 8d²)
    assert r.attn_params == {
        "MHA": 4 * d**2,
        "GQA": d * d + d * kv * h * 2 + d * d,          # W_Q, W_K, W_V (shrunk), W_O
        "MQA": d * d + d * h * 2 + d * d,
        "MLA": d * d + d * d_c + 2 * d_c * d + d * d,   # W_Q, W_DKV, W_UK + W_UV, W_O
    }
    assert r.ffn_params == d * (m * d) + (m * d) * d
    if m == 4:
        assert r.ffn_params == 8 * d**2
    # FLOPs: each (n×a)·(a×c) matmul costs 2·n·a·c
    mm = lambda rows, inner, cols: 2 * rows * inner * cols  # noqa: E731
    assert r.proj_flops["MHA"] == batch * 4 * mm(n, d, d) == batch * 8 * n * d**2
    assert r.proj_flops["GQA"] == batch * (2 * mm(n, d, d) + 2 * mm(n, d, kv * h))
    assert r.proj_flops["MQA"] == batch * (2 * mm(n, d, d) + 2 * mm(n, d, h))
    assert r.proj_flops["MLA"] == batch * (2 * mm(n, d, d) + mm(n, d, d_c) + 2 * mm(n, d_c, d))
    scores = H * mm(n, h, n)            # per head: Q_h K_hᵀ
    mixing = H * mm(n, n, h)            # per head: weights · V_h
    assert r.core_flops == batch * (scores + mixing) == batch * 4 * n * n * d
    assert r.ffn_flops == batch * (mm(n, d, m * d) + mm(n, m * d, d))
    if m == 4:
        assert r.ffn_flops == batch * 16 * n * d**2
        assert r.flops["MHA"] == batch * (24 * n * d**2 + 4 * n * n * d)
    # KV cache: K and V per token (MLA: the latent only)
    assert r.kv_bytes_per_token == {"MHA": 2 * H * h * b, "GQA": 2 * kv * h * b,
                                    "MQA": 2 * h * b, "MLA": d_c * b}
    assert r.kv_bytes == {k: v * n * batch for k, v in r.kv_bytes_per_token.items()}


def test_variants_shown_only_when_configured():
    r = report(512, 8, 128)
    assert set(r.attn_params) == {"MHA", "MQA"}
    assert set(report(512, 8, 128, n_kv_heads=8).attn_params) == {"MHA", "MQA"}
    assert set(report(512, 8, 128, n_kv_heads=2, kv_latent_dim=64).attn_params) == {
        "MHA", "GQA", "MQA", "MLA"}


def test_table_states_each_formula_and_value():
    r = report(4096, 32, 8192, n_kv_heads=8, kv_latent_dim=512)
    text = str(r)
    lines = text.splitlines()
    for row in r.rows:
        assert any(ln.strip().startswith(row.name) and row.formula in ln
                   and f"{row.value:,}" in ln for ln in lines), row
    assert "4d²" in text and "8nd²" in text and "4n²d" in text and "16nd²" in text
    assert "2·d·b" in text and "2d² + 2·d·(H_kv·h)" in text and "d_c·b" in text
    assert f"{4 * 4096**2:,}" in text                            # MHA attention params
    assert json.loads(json.dumps(r.to_dict()))["attn_params"]["GQA"] == r.attn_params["GQA"]


def test_parameter_counts_agree_with_the_layers():
    d, H = 48, 6
    for kv in (6, 3, 1):
        layer = ak.MultiHeadAttention(d, H, n_kv_heads=kv)
        name = {6: "MHA", 3: "GQA", 1: "MQA"}[kv]
        got = sum(p.numel() for p in layer.parameters())
        assert got == report(d, H, 4, n_kv_heads=kv).attn_params[name]
    mla = ak.MultiHeadLatentAttention(d, H, kv_latent_dim=10)
    assert sum(p.numel() for p in mla.parameters()) == report(
        d, H, 4, kv_latent_dim=10).attn_params["MLA"]
    # the KV cache a layer really fills has the size the model predicts
    with torch.no_grad():
        cache = ak.KVCache()
        ak.MultiHeadAttention(d, H, n_kv_heads=3).to(torch.bfloat16)(
            torch.randn(2, 5, d, dtype=torch.bfloat16), cache=cache)
    assert cache.nbytes == report(d, H, 5, n_kv_heads=3, batch=2).kv_bytes["GQA"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(d_model=10, n_heads=3, seq_len=4), "not divisible by n_heads=3"),
    (dict(d_model=16, n_heads=4, seq_len=4, n_kv_heads=3), "multiple of n_kv_heads=3"),
    (dict(d_model=0, n_heads=4, seq_len=4), "d_model must be an integer >= 1"),
    (dict(d_model=16, n_heads=4, seq_len=-1), "seq_len must be an integer >= 0"),
    (dict(d_model=16, n_heads=4, seq_len=4, kv_latent_dim=2.5), "kv_latent_dim"),
    (dict(d_model=16, n_heads=4, seq_len=4, dtype_bytes=True), "dtype_bytes"),
])
def test_bad_inputs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        report(**kwargs)


def test_run_cli_prints_table(capsys):
    assert run_cli(["--d-model", "4096", "--heads", "32", "--kv-heads", "8",
                    "--seq", "8192"]) == 0
    out = capsys.readouterr().out
    assert "GQA (H_kv=8)" in out and f"{8 * 8192 * 4096**2:,}" in out
    assert run_cli(["--d-model", "64", "--heads", "4", "--seq", "10", "--kv-latent", "8",
                    "--dtype", "float32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"]["MLA"] == 8 * 4
    assert data["dtype_bytes"] == 4


@pytest.mark.parametrize("argv", [
    ["--d-model", "10", "--heads", "3", "--seq", "5"],
    ["--d-model", "x", "--heads", "3", "--seq", "5"],
    ["--heads", "3", "--seq", "5"],
    ["--d-model", "16", "--heads", "4", "--seq", "5", "--dtype", "float7"],
])
def test_run_cli_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert run_cli(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnkit cost: error: ")


def test_attention_subtotal_next_to_the_ffn(capsys):
    """The course's lesson: attention 8nd² + 4n²d vs FFN 16nd² — equal at n = 2d."""
    d, n = 512, 1024
    r = report(d, 8, n)
    assert r.attention_flops["MHA"] == 8 * n * d**2 + 4 * n**2 * d == r.ffn_flops
    names = [row.name for row in r.rows if row.section == "forward FLOPs"]
    i = names.index("attention subtotal, MHA")
    assert names[i + 1].startswith("FFN")                      # printed side by side
    text = str(r)
    assert "8nd² + 4n²d" in text and "(2 + n/d) / 4 = 1.00" in text
    assert json.loads(json.dumps(r.to_dict()))["attention_flops"]["MHA"] == r.ffn_flops
    assert run_cli(["--d-model", "512", "--heads", "8", "--seq", "128"]) == 0
    out = capsys.readouterr().out
    assert "attention subtotal, MHA" in out and "(2 + n/d) / 4 = 0.56" in out
