"""Every built-in example prints the course's numbers (read back from the text output)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from attnkit.cli import main
from attnkit.explain.examples import DEFAULT, EXAMPLES, NUMPY_CODE
from helpers.outputs import korean_outputs, printed
from helpers.textparse import Section, all_close, close, parse


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
    listing, more = capsys.readouterr().out.strip().split("\n\n")
    lines = listing.splitlines()
    assert [ln.split()[0] for ln in lines] == list(EXAMPLES)
    # then where the rest of the course is (issue 22, defect 3): the lessons, the notebooks
    assert "attnkit lesson" in more and "sqrt-dk" in more
    assert "notebooks/course_en.ipynb" in more and 'pip install "attnkit[notebooks]"' in more
    for ln in lines:
        name, description = ln.split(None, 1)
        assert description == EXAMPLES[name].describe("en") and len(description) > 20
    assert main(["examples", "--lang", "ko"]) == 0
    ko_listing, ko_more = capsys.readouterr().out.strip().split("\n\n")
    ko = ko_listing.splitlines()
    assert [ln.split()[0] for ln in ko] == list(EXAMPLES)
    assert "레슨" in ko_more and "notebooks/course_ko.ipynb" in ko_more
    assert all(re.search("[가-힣]", ln) for ln in ko)


# ------------------------------------------------------- Korean as the course speaks it

# Hangul transliterations of the course's Latin-script terms (Query, Key, Value, Score, Mask,
# Softmax), and 점수 for Score: none of them may appear in Korean output (issue 12, item 5).
# (키 of the keyboard — "Tab 키", "화살표 키" — is another word.)
TRANSLITERATED = re.compile(r"소프트맥스|마스크|쿼리|스코어|밸류|점수|"
                            r"(?<![가-힣])(?<!Tab )(?<!화살표 )키(?=[를가의는에와로도 )]|$)")
# English words the Korean output once carried ("(K, V alike)", "8 heads → concat", ...);
# "head" itself is the course's word (issue 22), the English plural is not
ENGLISH = re.compile(r"\b(alike|concat|heads|raw|scores?|queries|keys|values|weights|output|"
                     r"scaled|sum to)\b")
# a particle written right after a shape such as (3, 8): its final sound decides the particle
SHAPE_PARTICLE = re.compile(r"\(\d+(?:, \d+)+\)(?:이어야|여야|[이가은는을를])(?![가-힣])")


def test_korean_keeps_the_courses_terms_in_latin_script(capsys):
    """No 소프트맥스 / 마스크 / 쿼리 / 키 / 점수 in any Korean output (was: "4. 소프트맥스
    (Softmax)", "마스크(−∞)로 가려져", "원점수"), and the step names are the Latin ones."""
    from attnkit.explain.inputs import MESSAGES
    from attnkit.explain.strings import STRINGS

    outputs = korean_outputs(capsys)
    outputs["strings"] = "\n".join(STRINGS["ko"].values())
    outputs["messages"] = "\n".join(MESSAGES["ko"].values())
    for name, text in outputs.items():
        bad = sorted({m.group(0) for m in TRANSLITERATED.finditer(text)})
        assert not bad, f"{name}: {bad}"
        assert not SHAPE_PARTICLE.search(text), (name, SHAPE_PARTICLE.search(text).group(0))
    for name in EXAMPLES:
        text = outputs[name]
        for step in ("1. MatMul", "3. Mask", "4. Softmax"):
            assert step in text, (name, step)
        prose = "\n".join(ln for ln in text.splitlines() if "#" not in ln)   # not the code
        assert not ENGLISH.search(prose), (name, ENGLISH.search(prose).group(0))


def test_korean_particles_after_the_courses_terms(capsys):
    """The particle after a Latin word follows how it is read (소프트맥스, 마스크: a vowel):
    Softmax는/가/를, Mask로/가; word labels are quoted before a particle ('학교에'의)."""
    outputs = korean_outputs(capsys)
    text = "\n".join(outputs.values())
    for wrong in ("Softmax은", "Softmax이 ", "Softmax을", "Mask은", "Mask이 ", "Mask을",
                  "Key은", "Key을", "Query은", "Query을", "Value은", "Value을", "Score은",
                  "Score을", "Score이 "):
        assert wrong not in text, wrong
    assert "Softmax는" in text and "Mask(−∞)로 가려져" in outputs["masked"]
    assert "Key '학교에'의 가중치는" in outputs["cross"]
    assert "Key 'I'의 가중치는" in outputs["multihead"]
    assert "Query q1: Key k3의 Score(3.000)가 가장 컸지만" in outputs["masked"]
