"""Every built-in example prints the course's numbers (read back from the text output)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from textparse import Section, all_close, close, parse

from attnkit.cli import main
from attnkit.explain.examples import DEFAULT, EXAMPLES, NUMPY_CODE


def printed(capsys: pytest.CaptureFixture[str], name: str, lang: str = "en") -> str:
    assert main(["explain", "--example", name, "--lang", lang, "--color", "never"]) == 0
    return capsys.readouterr().out


def sections(capsys: pytest.CaptureFixture[str], name: str, lang: str = "en") -> list[Section]:
    return parse(printed(capsys, name, lang))


def row(sec: Section, step: str, i: int = 0, head: str | None = None) -> list[float]:
    return sec.values(step, head)[i]


def test_every_example_prints_five_steps_with_weights_summing_to_one(capsys):
    for name in EXAMPLES:
        for sec in sections(capsys, name):
            assert [sec.steps[str(i)].name for i in range(1, 6)] == [
                "MatMul", "Scale", "Mask", "Softmax", "MatMul"], name
            for label, m in sec.steps["4"].heads.items():
                assert m.sums, (name, label)
                assert all(close(s, "1.000") for s in m.sums), (name, label, m.sums)


def test_default_is_the_causal_three_token_example(capsys):
    assert DEFAULT == "causal"
    assert main(["explain"]) == 0
    default = capsys.readouterr().out
    assert default == printed(capsys, "causal")


def test_a_masked_key_with_the_largest_score_contributes_nothing(capsys):
    text = printed(capsys, "masked")
    (sec,) = parse(text)
    assert all_close(row(sec, "1"), ["1.5", "2", "3"])
    assert all_close(row(sec, "2"), ["0.75", "1", "1.5"])
    assert all_close(row(sec, "3"), ["0.75", "1", "-inf"])
    assert all_close(row(sec, "4"), ["0.44", "0.56", "0"])
    assert row(sec, "4")[2] == 0.0                       # exactly nothing
    # the output only mixes v1 and v2: the masked key's value [10, 10] never shows up
    assert all_close(row(sec, "5"), ["0.438", "0.562"])
    assert "k3 had the largest raw score (3.000) but is masked" in text


def test_b_worked_example_and_sharpening(capsys):
    main_sec, sharp = sections(capsys, "worked")
    assert all_close(row(main_sec, "1"), ["2", "0", "1"])
    assert all_close(row(main_sec, "2"), ["1", "0", "0.5"])
    assert all_close(row(main_sec, "4"), ["0.51", "0.19", "0.31"])
    assert all_close(row(main_sec, "5"), ["0.66", "0.34"])
    assert "q1·k2 = 0, yet k2 still gets weight 0.186" in main_sec.text
    # the same logits ×10
    assert all_close(row(sharp, "3"), ["10", "0", "5"])
    assert all_close(row(sharp, "4"), ["0.993", "0.00005", "0.007"])
    assert "saturated" in sharp.text


def test_c_scaling_by_one_over_root_dk(capsys):
    raw, scaled = sections(capsys, "scaling")
    assert raw.steps["1"].matrix.values == [[16.0, 8.0, 0.0]]
    assert all_close(row(raw, "3"), ["16", "8", "0"])
    assert all_close(row(raw, "4"), ["0.9997", "0.0003", "≈0"])
    assert "saturated" in raw.text and "1/√d_k = 0.125" in raw.text
    assert "S · 1/√64" in scaled.text
    assert all_close(row(scaled, "2"), ["2", "1", "0"])
    assert all_close(row(scaled, "4"), ["0.665", "0.245", "0.090"])
    assert "saturated" not in scaled.text
    # d_k = 64 is printed as a corner, not 64 columns
    assert "1 × 64: showing a corner" in raw.text


def test_d_two_tokens_numpy(capsys):
    (sec,) = sections(capsys, "numpy")
    assert sec.values("1") == [[2.0, 2.0], [0.0, 2.0]]
    assert all_close(row(sec, "4", 0), ["0.5", "0.5"])
    assert all_close(row(sec, "4", 1), ["0.27", "0.73"])
    assert all_close(row(sec, "5", 0), ["5", "5"])
    assert all_close(row(sec, "5", 1), ["2.7", "7.3"])
    # the NumPy code shown in the intro is real code that gives the printed output
    assert "S = Q @ K.T" in sec.text
    ns: dict = {}
    exec(NUMPY_CODE, {"np": np}, ns)
    np.testing.assert_allclose(ns["O"], sec.values("5"), atol=5e-4)


def test_e_three_tokens_causal(capsys):
    (sec,) = sections(capsys, "causal")
    logits = sec.values("3")
    assert [logits[0][1], logits[0][2], logits[1][2]] == [-math.inf] * 3
    assert all_close(row(sec, "4", 2), ["0.114", "0.042", "0.844"])
    assert all_close(row(sec, "4", 1), ["0.818", "0.182", "0"])


def test_f_multihead_outputs_are_concatenated(capsys):
    (sec,) = sections(capsys, "multihead")
    heads = list(sec.steps["5"].heads)
    assert heads == ["head 1", "head 2"]
    assert sec.steps["1"].shape == (2, 3, 3)
    assert sec.steps["5"].shape == (2, 3, 4)
    concat = sec.steps["6"]
    assert concat.name == "Concat" and concat.shape == (3, 8)
    per_head = [np.array(sec.values("5", h)) for h in heads]
    np.testing.assert_allclose(np.array(concat.matrix.values), np.concatenate(per_head, 1))
    # each head is its own attention over its 4-wide slice (recomputed from the printed inputs)
    tr = EXAMPLES["multihead"].build()
    for h in range(2):
        s = tr.q[h] @ tr.k[h].T / 2.0
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        np.testing.assert_allclose(sec.values("4", heads[h]), w, atol=5e-4)
        np.testing.assert_allclose(per_head[h], w @ tr.v[h], atol=5e-4)
    assert concat.matrix.rows == ["I", "like", "tea"]


def test_g_base_model_shape_walk(capsys):
    text = printed(capsys, "shapes")
    for piece in ("X (10, 512)", "W_Q (512, 64)", "Q (10, 64)", "QKᵀ (10, 10)",
                  "head (10, 64)", "8 heads", "concat (10, 512)"):
        assert piece in text, piece
    (sec,) = parse(text)
    assert sec.steps["1"].shape == (8, 10, 10)
    assert sec.steps["5"].shape == (8, 10, 64)
    assert sec.steps["6"].shape == (10, 512)
    assert len(sec.steps["5"].heads) == 1                # one head printed, the rest summarised
    assert "7 more heads" in text
    assert max(len(line) for line in text.splitlines()) < 140      # nothing printed 512 wide
    printed_cols = sec.steps["6"].matrix.cols
    assert "d512" in printed_cols and len(printed_cols) <= 11


def test_h_cross_attention_with_word_labels(capsys):
    (sec,) = sections(capsys, "cross")
    w = sec.steps["4"].matrix
    assert w.cols == ["나는", "학교에", "간다"]
    assert w.rows == ["I", "go", "to", "school"]
    best = {r: w.cols[int(np.argmax(v))] for r, v in zip(w.rows, w.values, strict=True)}
    assert best == {"I": "나는", "go": "간다", "to": "학교에", "school": "학교에"}
    assert sec.steps["4"].shape == (4, 3) and sec.steps["5"].shape == (4, 3)
    assert "cross-attention" in sec.text


def test_i_shared_w_gives_symmetric_scores(capsys):
    tied, apart = sections(capsys, "shared-qk")
    s = np.array(tied.values("1"))
    np.testing.assert_array_equal(s, s.T)
    assert np.all(np.diag(s) >= 0)
    assert "S is symmetric" in tied.text
    s2 = np.array(apart.values("1"))
    assert not np.array_equal(s2, s2.T)
    assert "S is symmetric" not in apart.text


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_korean_prints_the_same_numbers(capsys, name):
    en, ko = sections(capsys, name, "en"), sections(capsys, name, "ko")
    assert len(en) == len(ko)
    for a, b in zip(en, ko, strict=True):
        assert a.steps.keys() == b.steps.keys()
        for key in a.steps:
            assert list(a.steps[key].heads.values()) != []
            assert [m.values for m in a.steps[key].heads.values()] == [
                m.values for m in b.steps[key].heads.values()]
    text = printed(capsys, name, "ko")
    assert re.search("[가-힣]", text)
    assert "what it does" not in text and "What to notice" not in text


def test_examples_command_lists_every_example_with_a_description(capsys):
    assert main(["examples"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == list(EXAMPLES)
    for ln in lines:
        name, description = ln.split(None, 1)
        assert description == EXAMPLES[name].describe("en") and len(description) > 20
    assert main(["examples", "--lang", "ko"]) == 0
    ko = capsys.readouterr().out.strip().splitlines()
    assert [ln.split()[0] for ln in ko] == list(EXAMPLES)
    assert all(re.search("[가-힣]", ln) for ln in ko)
