"""The ``attnkit`` command line: examples, user inputs in every format, every bad input."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from attnkit.cli import main
from attnkit.explain.inputs import MESSAGES
from helpers.textparse import all_close, parse

Q = np.array([[1.0, 0, 1, 0], [0, 1, 0, 1]])
K = np.array([[1.0, 0, 1, 0], [1, 1, 1, 1]])
V = np.array([[10.0, 0], [0, 10]])


def write(path: Path, a: np.ndarray) -> Path:
    """Save ``a`` in the format the extension names."""
    if path.suffix == ".npy":
        np.save(path, a)
    elif path.suffix == ".json":
        path.write_text(json.dumps(np.asarray(a).tolist()))
    else:
        rows = np.atleast_2d(a)
        path.write_text("\n".join(",".join(
            ("true" if x else "false") if isinstance(x, (bool, np.bool_)) else repr(float(x))
            for x in r) for r in rows) + "\n")
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["explain", "--color", "never", *argv] if argv[:1] != ("examples",) else argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("ext", [".npy", ".json", ".csv"])
def test_user_inputs_in_each_format(tmp_path, capsys, ext):
    q, k, v = (write(tmp_path / f"{n}{ext}", a) for n, a in (("q", Q), ("k", K), ("v", V)))
    rc, out, err = run(capsys, "--q", str(q), "--k", str(k), "--v", str(v))
    assert rc == 0, err
    (sec,) = parse(out)
    assert sec.values("1") == [[2.0, 2.0], [0.0, 2.0]]
    assert all_close(sec.values("4")[1], ["0.269", "0.731"])
    assert all_close(sec.values("5")[1], ["2.689", "7.311"])


def test_mixed_formats_and_self_attention_default(tmp_path, capsys):
    q = write(tmp_path / "x.csv", Q)
    rc, out, _ = run(capsys, "--q", str(q))            # k and v default to q
    assert rc == 0
    (sec,) = parse(out)
    assert sec.values("1") == (Q @ Q.T).tolist()
    rc, out, _ = run(capsys, "--q", str(q), "--k", str(write(tmp_path / "k.npy", K)),
                     "--v", str(write(tmp_path / "v.json", V)))
    assert rc == 0 and parse(out)[0].values("1") == [[2.0, 2.0], [0.0, 2.0]]


def test_one_dimensional_file_is_one_query(tmp_path, capsys):
    q = tmp_path / "q.json"
    q.write_text("[1, 0, 1, 0]")
    rc, out, _ = run(capsys, "--q", str(q), "--k", str(write(tmp_path / "k.csv", K)),
                     "--v", str(write(tmp_path / "v.csv", V)))
    assert rc == 0 and parse(out)[0].steps["4"].shape == (1, 2)


@pytest.mark.parametrize(("ext", "mask"), [
    (".json", np.array([[True, False], [True, True]])),
    (".csv", np.array([[True, False], [True, True]])),
    (".npy", np.array([[True, False], [True, True]])),
    (".csv", np.array([[0.0, -math.inf], [0.0, 0.0]])),
    (".npy", np.array([[0.0, -math.inf], [0.0, 0.0]])),
])
def test_mask_file_bool_or_minus_inf(tmp_path, capsys, ext, mask):
    files = [write(tmp_path / f"{n}.npy", a) for n, a in (("q", Q), ("k", K), ("v", V))]
    m = write(tmp_path / f"m{ext}", mask)
    rc, out, err = run(capsys, "--q", str(files[0]), "--k", str(files[1]), "--v", str(files[2]),
                       "--mask", str(m))
    assert rc == 0, err
    (sec,) = parse(out)
    assert sec.values("3")[0][1] == -math.inf
    assert sec.values("4")[0] == [1.0, 0.0]
    assert sec.values("5")[0] == [10.0, 0.0]


def test_json_mask_with_minus_infinity(tmp_path, capsys):
    files = [write(tmp_path / f"{n}.json", a) for n, a in (("q", Q), ("k", K), ("v", V))]
    m = tmp_path / "m.json"
    m.write_text('[[0, -Infinity]]')                   # one row shared by both queries
    rc, out, err = run(capsys, "--q", str(files[0]), "--k", str(files[1]), "--v", str(files[2]),
                       "--mask", str(m))
    assert rc == 0, err
    assert [r[1] for r in parse(out)[0].values("3")] == [-math.inf, -math.inf]


def test_causal_scale_softcap_heads(tmp_path, capsys):
    x = np.arange(24, dtype=float).reshape(3, 8) / 10
    q = write(tmp_path / "x.npy", x)
    rc, out, _ = run(capsys, "--q", str(q), "--causal")
    assert rc == 0
    logits = parse(out)[0].values("3")
    assert logits[0][1:] == [-math.inf, -math.inf] and "mask: causal" in out
    rc, out, _ = run(capsys, "--q", str(q), "--scale", "0.25")
    assert rc == 0
    sec = parse(out)[0]
    np.testing.assert_allclose(sec.values("2"), (x @ x.T) * 0.25, atol=5e-4)
    rc, out, _ = run(capsys, "--q", str(q), "--scale", "1", "--softcap", "2")
    assert rc == 0
    assert max(max(r) for r in parse(out)[0].values("2")) <= 2.0
    rc, out, _ = run(capsys, "--q", str(q), "--heads", "2", "--q-labels", "a,b,c")
    assert rc == 0
    sec = parse(out)[0]
    assert list(sec.steps["4"].heads) == ["head 1", "head 2"]
    assert sec.steps["6"].shape == (3, 8) and sec.steps["4"].matrix.rows == ["a", "b", "c"]
    h1 = x[:, :4]
    s = h1 @ h1.T / 2
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    np.testing.assert_allclose(sec.values("4", "head 1"), w, atol=5e-4)


def test_example_with_a_different_scale(capsys):
    rc, out, _ = run(capsys, "--example", "worked", "--scale", "1")
    assert rc == 0
    sec = parse(out)[0]
    assert all_close(sec.values("3")[0], ["2", "0", "1"])
    assert "[scale = 1]" in sec.title


@pytest.mark.parametrize("lang", ["en", "ko"])
def test_an_example_under_an_override_says_the_values_used(capsys, lang):
    rc, out, _ = run(capsys, "--example", "worked", "--scale", "1", "--lang", lang)
    assert rc == 0
    assert "1/√d_k = 1/2" not in out and "√d_k = 2로 나누고" not in out  # the example's own text
    assert "[0.665, 0.090, 0.245]" in out                              # softmax([2, 0, 1])
    assert ("scale = 1/√4 = 0.500" in out) and len(parse(out)) == 1    # ×10 half left out
    assert ("Left out" in out) if lang == "en" else ("뺀 비교" in out)
    rc, out, _ = run(capsys, "--example", "causal", "--scale", "2")
    secs = parse(out)
    assert rc == 0 and len(secs) == 1 and "scale = 2.000" in out


def test_row_sums_print_as_one(capsys):
    from attnkit.explain.common import fmt

    assert fmt(0.99999999) == "1.000" and fmt(1 - 4e-7) == "1.000" and fmt(0.9997) == "0.9997"
    rc, out, _ = run(capsys, "--example", "worked")
    assert rc == 0 and "1.0e+00" not in out


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"attnkit {version('attnkit')}"
    # `python -m attnkit` runs this same main() (a real process each: the two tests below)


def test_model_options_need_model(capsys):
    rc, _, err = run(capsys, "--layer", "2", "--token", "it")
    assert rc == 2 and "--layer, --token: only with --model" in err


def test_korean_output(capsys):
    rc, out, _ = run(capsys, "--example", "masked", "--lang", "ko")
    assert rc == 0
    assert "단계" in out and "가장 컸지만 Mask" in out
    assert all_close(parse(out)[0].values("4")[0], ["0.44", "0.56", "0"])


def test_html_and_plot_outputs(tmp_path, capsys):
    page, png = tmp_path / "p.html", tmp_path / "p.png"
    rc, out, err = run(capsys, "--example", "worked", "--html", str(page), "--plot", str(png),
                       "--plot-steps", "logits,weights")
    assert rc == 0, err
    assert page.read_text(encoding="utf-8").startswith("<!doctype html>")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(page) in err and str(png) in err
    assert parse(out)[0].values("4")                 # the text is still printed


# ---------------------------------------------------------------------------- bad input


def bad_cases(tmp: Path) -> list[tuple[list[str], list[str]]]:
    """(argv, words the one-line message must contain)."""
    q = write(tmp / "q.npy", Q)
    k5 = write(tmp / "k5.csv", np.ones((2, 5)))
    v3 = write(tmp / "v3.json", np.ones((3, 2)))
    (tmp / "ragged.json").write_text("[[1, 2], [3]]")
    (tmp / "broken.json").write_text("[[1, 2],")
    (tmp / "words.csv").write_text("1,a\n")
    (tmp / "ragged.csv").write_text("1,2\n3\n")
    (tmp / "notes.txt").write_text("1 2")
    (tmp / "pickle.npy").write_bytes(b"not a numpy file")
    (tmp / "nan.csv").write_text("1,nan\n0,1\n")
    (tmp / "m01.json").write_text("[[0, 1], [1, 1]]")
    (tmp / "empty.json").write_text("[[]]")
    m3 = write(tmp / "m3.json", np.ones((3, 3), dtype=bool))
    (tmp / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp / "deep9.json").write_text("[" * 9 + "1" + "]" * 9)
    (tmp / "bigint.json").write_text("[[1" + "0" * 400 + ", 1]]")
    (tmp / "hugeint.json").write_text("[[1" + "0" * 5000 + ", 1]]")
    (tmp / "latin1.csv").write_bytes(b"1,\xe9\n")
    (tmp / "folder").mkdir()
    (tmp / "folder.npy").mkdir()
    (tmp / "e308.json").write_text("[[1e308, 1e308], [1, 2]]")
    fives = write(tmp / "fives.npy", np.full((2, 4), 5.0))
    tall = write(tmp / "tall.npy", np.zeros((2049, 1)))
    from numpy.lib import format as npy

    with (tmp / "header.npy").open("wb") as f:          # a header promising 25M values
        npy.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False,
                                       "shape": (5000, 5000)})
    with (tmp / "huge.csv").open("wb") as f:
        f.truncate(300 * 2 ** 20)                         # sparse: 300 MB, nothing written
    return [
        (["--example", "nope"], ["unknown example 'nope'", "causal", "attnkit examples"]),
        (["--q", str(tmp / "missing.npy")], ["missing.npy", "no such file"]),
        (["--q", str(tmp / "notes.txt")], ["notes.txt", ".npy, .json, .csv"]),
        (["--q", str(tmp / "ragged.json")], ["ragged.json", "different lengths"]),
        (["--q", str(tmp / "broken.json")], ["broken.json", "not valid JSON"]),
        (["--q", str(tmp / "words.csv")], ["words.csv", "row 1, column 2", "'a'"]),
        (["--q", str(tmp / "ragged.csv")], ["ragged.csv", "2 different lengths",
                                             "2 (1), 1 (2)"]),
        (["--q", str(tmp / "pickle.npy")], ["pickle.npy", ".npy"]),
        (["--q", str(tmp / "nan.csv")], ["nan.csv", "non-finite"]),
        (["--q", str(tmp / "empty.json")], ["empty.json", "(1, 0)", "at least one row"]),
        (["--q", str(q), "--k", str(k5)], ["q.npy (2, 4)", "k5.csv (2, 5)", "d_k 4 vs 5"]),
        (["--q", str(q), "--v", str(v3)], ["q.npy (2, 4)", "v3.json (3, 2)", "n_k 2 vs 3"]),
        (["--q", str(q), "--heads", "3"], ["--heads 3", "q.npy (2, 4)", "1, 2, 4"]),
        (["--q", str(q), "--mask", str(m3)], ["m3.json", "(3, 3)", "(n_q, n_k) = (2, 2)"]),
        (["--q", str(q), "--mask", str(tmp / "m01.json")], ["m01.json", "true/false"]),
        (["--q", str(q), "--mask", str(m3), "--causal"], ["--causal or --mask"]),
        (["--q", str(q), "--softcap", "-1"], ["softcap must be > 0", "q.npy"]),
        (["--q", str(q), "--scale", "inf"], ["--scale must be a finite number"]),
        (["--q", str(q), "--q-labels", "a,b,c"], ["--q-labels has 3 labels", "2 queries"]),
        (["--q", str(q), "--example", "worked"], ["either --example or"]),
        (["--causal"], ["--causal", "--q FILE"]),
        (["--lang", "fr"], ["invalid choice: 'fr'"]),
        (["--plot", str(tmp / "x.png"), "--plot-steps", "attention"],
         ["--plot-steps 'attention'", "scores, scaled, logits, weights"]),
        (["--q", str(q), "--html", str(tmp / "no" / "dir" / "p.html")], ["cannot write --html"]),
        (["--q", str(tmp / "deep.json")], ["deep.json", "100,000 deep", "at most 4 levels"]),
        (["--q", str(tmp / "deep9.json")], ["deep9.json", "9 deep"]),
        (["--q", str(tmp / "bigint.json")], ["bigint.json", "too large for float64"]),
        (["--q", str(tmp / "hugeint.json")], ["hugeint.json", "too large for float64"]),
        (["--q", str(tmp / "latin1.csv")], ["latin1.csv", "not UTF-8"]),
        (["--q", str(tmp / "folder")], ["folder", "it is a folder"]),
        (["--q", str(tmp / "folder.npy")], ["folder.npy", "it is a folder"]),
        (["--q", str(q), "--mask", str(tmp / "folder")], ["mask file", "it is a folder"]),
        (["--q", str(tmp / "e308.json")], ["overflows float64 at query q1, key k1",
                                            "1.000e+308"]),
        (["--q", str(fives), "--scale", "1e307"], ["S · scale overflows float64",
                                                   "S = 100.000"]),
        (["--q", str(tall)], ["4,198,401 scores", "limit of 4,194,304"]),
        (["--q", str(tmp / "header.npy")], ["header.npy", "(5000, 5000)", "16,777,216"]),
        (["--q", str(tmp / "huge.csv")], ["huge.csv", "300 MB",
                                          "save the array as .npy (numpy.save)"]),
    ]


def test_every_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    for argv, words in bad_cases(tmp_path):
        rc, _, err = run(capsys, *argv)
        assert rc == 2, argv
        lines = err.strip().splitlines()
        assert len(lines) == 1, (argv, err)
        for w in words:
            assert w in lines[0], (argv, w, lines[0])
        assert "Traceback" not in err


def test_bad_input_messages_in_korean(tmp_path, capsys):
    for argv, words in bad_cases(tmp_path):
        if "--lang" in argv:
            continue                      # argparse's own message
        rc, _, err = run(capsys, *argv, "--lang", "ko")
        assert rc == 2, argv
        (line,) = err.strip().splitlines()
        assert re.search("[가-힣]", line), line
        for w in words:                   # file names and shapes are the same in Korean
            if re.search(r"\.(npy|json|csv|txt)$|^\(", w):
                assert w in line, (w, line)


def test_no_message_is_a_huge_number(tmp_path, capsys):
    for argv, _ in bad_cases(tmp_path):
        _, _, err = run(capsys, *argv)
        assert not re.search(r"\d{25}", err), err             # 1e308 was 309 digits


def test_plot_warnings_are_one_line_notes(tmp_path, capsys, monkeypatch):
    from attnkit.explain import plot as plot_mod

    monkeypatch.setattr(plot_mod, "cjk_font", lambda: None)     # no Hangul font
    rc, _, err = run(capsys, "--lang", "ko", "--plot", str(tmp_path / "k.png"))
    assert rc == 0
    lines = err.strip().splitlines()
    assert lines[0].startswith("attnkit explain: note: no font with Hangul found"), err
    assert len(lines) == 2 and "wrote" in lines[1]


def test_csv_with_a_byte_order_mark(tmp_path, capsys):
    (tmp_path / "bom.csv").write_text("1,0,1,0\n0,1,0,1\n", encoding="utf-8-sig")   # Excel
    rc, out, err = run(capsys, "--q", str(tmp_path / "bom.csv"))
    assert rc == 0, err
    assert parse(out)[0].values("1") == (Q @ Q.T).tolist()


def test_huge_and_tiny_values_print_in_scientific_notation(tmp_path, capsys):
    q = write(tmp_path / "q.json", np.array([[1e200, 0], [0, 1]]))
    k = write(tmp_path / "k.json", np.array([[1e-200, 0], [0, 1]]))
    rc, out, err = run(capsys, "--q", str(q), "--k", str(k))
    assert rc == 0, err
    assert "1.000e+200" in out and "1.0e-200" in out
    assert not re.search(r"\d{25}", out)                     # was a 201-digit integer


def test_large_input_page_is_small(tmp_path, capsys):
    x = write(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((1000, 8)))
    page = tmp_path / "p.html"
    rc, out, err = run(capsys, "--q", str(x), "--causal", "--html", str(page))
    assert rc == 0, err
    assert page.stat().st_size < 2_000_000                   # was 208 MB
    assert "showing a corner (the --html page shows it in blocks of means)" in out


def test_every_message_exists_in_both_languages():
    assert MESSAGES["en"].keys() == MESSAGES["ko"].keys()
    for key, en in MESSAGES["en"].items():
        names = sorted(re.findall(r"{(\w+)", en))
        assert sorted(re.findall(r"{(\w+)", MESSAGES["ko"][key])) == names, key


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    (tmp_path / "ragged.json").write_text("[[1, 2], [3]]")
    r = subprocess.run([sys.executable, "-m", "attnkit", "explain", "--q",
                        str(tmp_path / "ragged.json")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "ragged.json" in r.stderr


def test_python_dash_m_prints_the_default_example():
    r = subprocess.run([sys.executable, "-m", "attnkit", "explain"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "\033[" not in r.stdout         # not a terminal: no colour
    assert all_close(parse(r.stdout)[0].values("4")[2], ["0.114", "0.042", "0.844"])


# ---------------------------------------------------------------------------- delegation


@pytest.mark.parametrize("name", ["bench", "cost"])
def test_subcommands_are_handed_over_unparsed(monkeypatch, name):
    seen = []
    fake = types.ModuleType(f"attnkit.{name}")
    fake.run_cli = lambda argv: seen.append(argv) or 7            # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, f"attnkit.{name}", fake)
    assert main([name, "--quick", "-x", "pos", "--lang", "ko"]) == 7
    assert seen == [["--quick", "-x", "pos", "--lang", "ko"]]


@pytest.mark.parametrize("name", ["bench", "cost"])
def test_missing_subcommand_module_is_one_line_exit_2(monkeypatch, capsys, name):
    monkeypatch.setitem(sys.modules, f"attnkit.{name}", None)     # import fails
    assert main([name, "--anything"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"attnkit {name}: not available" in err[0]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("explain", "examples", "bench", "cost"):
        assert cmd in out


def test_bare_attnkit_and_decimals(capsys):
    assert main([]) == 0
    bare = capsys.readouterr().out
    assert main(["explain"]) == 0
    assert capsys.readouterr().out == bare
    rc, out, _ = run(capsys, "--decimals", "2")
    assert rc == 0
    assert parse(out)[0].values("4")[2] == [0.11, 0.04, 0.84]
    rc, _, err = run(capsys, "--decimals", "-1")
    assert rc == 2 and "--decimals must be between 0 and 12" in err


def test_output_paths_are_checked_before_any_work(tmp_path, capsys):
    rc, out, err = run(capsys, "--plot", str(tmp_path / "heat.pdf"))
    assert rc == 2 and out == "" and "ending in .png" in err
    rc, out, err = run(capsys, "--html", str(tmp_path / "missing" / "page.html"))
    assert rc == 2 and out == "" and "does not exist" in err and "missing" in err
    rc, out, err = run(capsys, "--plot", str(tmp_path))
    assert rc == 2 and out == "" and "directory" in err


# ---------------------------------------------------------------------------- output files
def test_an_output_over_an_input_file_is_refused_even_with_force(tmp_path, capsys):
    """`--html q.csv` once wrote the page over the input and said "wrote q.csv" (issue 19)."""
    q = write(tmp_path / "q.csv", Q)
    k = write(tmp_path / "k.json", K)
    v = write(tmp_path / "v.npy", V)
    m = write(tmp_path / "m.csv", np.ones((2, 2), dtype=bool))
    link = tmp_path / "link.html"
    link.symlink_to(q)
    before = {p: p.read_bytes() for p in (q, k, v, m)}
    given = ["--q", str(q), "--k", str(k), "--v", str(v), "--mask", str(m)]
    for target, flag in ((q, "--q"), (k, "--k"), (v, "--v"), (m, "--mask"), (link, "--q")):
        for force in ([], ["--force"]):
            rc, out, err = run(capsys, *given, "--html", str(target), *force)
            assert rc == 2 and out == "", (target, err)
            (line,) = err.strip().splitlines()
            assert f"--html {target} is also the {flag} input" in line, line
            assert "another name" in line and "wrote" not in err
    assert {p: p.read_bytes() for p in before} == before
    rc, _, err = run(capsys, "--q", str(q), "--html", str(q), "--lang", "ko")
    assert rc == 2 and "입력 파일" in err and q.read_bytes() == before[q]


def test_an_existing_file_attnkit_did_not_write_needs_force(tmp_path, capsys):
    notes = tmp_path / "notes.html"
    notes.write_text("my notes\n")
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)       # a PNG attnkit did not draw
    for opt, path, kind in (("--html", notes, "HTML"), ("--plot", photo, "PNG")):
        before = path.read_bytes()
        rc, out, err = run(capsys, "--example", "worked", opt, str(path))
        assert rc == 2 and out == "", err
        assert f"{opt} {path} already exists and is not {kind} output of attnkit" in err
        assert "--force" in err and path.read_bytes() == before
        rc, _, err = run(capsys, "--example", "worked", opt, str(path), "--force")
        assert rc == 0, err
        assert path.read_bytes() != before
    assert notes.read_text(encoding="utf-8").startswith("<!doctype html>")


def test_earlier_outputs_are_replaced_without_force(tmp_path, capsys):
    page, png = tmp_path / "p.html", tmp_path / "p.png"
    for _ in range(2):
        rc, _, err = run(capsys, "--example", "worked", "--html", str(page), "--plot", str(png))
        assert rc == 0, err
    for lang in ("en", "ko"):           # a page from before the generator tag: its footer
        text = page.read_text(encoding="utf-8")
        old = text.replace('<meta name="generator" content="attnkit">', "")
        if lang == "ko":
            old = old.replace("Made by attnkit", "attnkit으로 만든")
        page.write_text(old, encoding="utf-8")
        rc, _, err = run(capsys, "--example", "worked", "--html", str(page))
        assert rc == 0, err


def test_two_outputs_never_share_a_file(tmp_path, capsys):
    both = tmp_path / "both.png"
    rc, out, err = run(capsys, "--example", "worked", "--html", str(both), "--plot", str(both))
    assert rc == 2 and out == "" and not both.exists()
    assert f"--html and --plot both name {both}" in err


def test_lesson_and_model_outputs_are_guarded_too(tmp_path, capsys):
    notes = tmp_path / "notes.png"
    notes.write_text("not a picture")
    rc = main(["lesson", "sqrt-dk", "--plot", str(notes)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "is not PNG output of attnkit" in err
    assert notes.read_text() == "not a picture"
    page = tmp_path / "notes.html"
    page.write_text("mine")
    rc = main(["explain", "--model", "minilm", "--html", str(page)])   # before the model loads
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "is not HTML output of attnkit" in err
    assert page.read_text() == "mine"


def test_a_ragged_csv_message_stays_short(tmp_path, capsys):
    """The message once listed every row's length (hundreds of numbers)."""
    rows = [",".join(["1"] * 64)] * 10 + [",".join(["1"] * 63)] + [",".join(["1"] * 64)] * 300
    rows += [",".join(["1"] * 65)] * 5
    (tmp_path / "r.csv").write_text("\n".join(rows) + "\n")
    rc, _, err = run(capsys, "--q", str(tmp_path / "r.csv"))
    assert rc == 2
    (line,) = err.strip().splitlines()
    assert "rows have 3 different lengths" in line
    assert "64 (1–10, 12–311), 65 (312–316), 63 (11)" in line, line
    many = [",".join(["1"] * (1 + i % 200)) for i in range(1000)]      # 200 lengths
    (tmp_path / "m.csv").write_text("\n".join(many) + "\n")
    rc, _, err = run(capsys, "--q", str(tmp_path / "m.csv"))
    (line,) = err.strip().splitlines()
    assert rc == 2 and "200 different lengths" in line and "… (+196)" in line
    assert "201, 401, …" in line and len(line) < 400, line
