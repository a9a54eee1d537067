"""`attnkit bench` explains itself: progress, --list, --only's help, named peers, the noise
verdict, --json, --plot and the missing-matplotlib message.

Everything runs in-process on the hidden ``--tiny`` case set (seconds). Never asserts on speed.
"""

from __future__ import annotations

import builtins
import json
import re
import sys

import pytest

from attnkit import bench
from attnkit.cli import main


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny run with --json and --plot; (stdout, stderr, json, png path)."""
    out = tmp_path_factory.mktemp("bench")
    js, png = out / "b.json", out / "b.png"
    mp = pytest.MonkeyPatch()
    import io

    so, se = io.StringIO(), io.StringIO()
    mp.setattr(sys, "stdout", so)
    mp.setattr(sys, "stderr", se)
    try:
        rc = main(["bench", "--tiny", "--json", str(js), "--plot", str(png)])
    finally:
        mp.undo()
    assert rc == 0, se.getvalue()
    return so.getvalue(), se.getvalue(), json.loads(js.read_text()), png


def test_progress_lines_count_cases_and_estimate_time_left(tiny_run):
    _, err, _, _ = tiny_run
    n = len(bench._cases("tiny"))
    lines = [ln for ln in err.splitlines() if ln.startswith("[bench] case")]
    assert len(lines) == n
    for i, ln in enumerate(lines, 1):
        assert re.match(rf"\[bench\] case {i} of {n}: .+ — \d+ s elapsed, about \d+ s left$",
                        ln), ln
    assert f"[bench] done: {n} cases in" in err


def test_table_says_which_way_is_better_and_names_every_peer(tiny_run):
    out, _, _, _ = tiny_run
    assert "speedup (>1 = attnkit faster)" in out
    assert "median of 2 runs" in out and "1 runs" not in out
    assert "ref:" not in out                       # the baseline rows say what they are
    for peer in ("sdpa", "naive"):
        assert bench.PEERS[peer] in out
    assert "attnkit on 'baseline causal fwd+bwd N=64' (the same call without" in out
    # a skipped peer says why, on its own row
    assert re.search(r"flex .*skipped: ", out)


def test_noise_verdict_comes_from_the_yardsticks(tiny_run):
    out, _, data, _ = tiny_run
    nz = data["meta"]["noise"]
    assert nz["samples"] == sum(c.repeat for c in bench._cases("tiny"))
    assert re.search(r"^Noise: machine (busy: ratios uncertain by|steady: ratios good to "
                     r"about) ", out, re.M)
    assert nz["verdict"] in out
    assert nz["busy"] == (nz["pct"] > bench.BUSY_PCT)


def test_noise_verdict_busy_and_steady():
    steady, busy = bench.Case("a", 1, 1), bench.Case("b", 1, 1)
    steady.results["sgemm_samples"] = [100e9, 101e9, 99e9]
    busy.results["sgemm_samples"] = [100e9, 60e9, 140e9]
    assert not bench.noise([steady])["busy"]
    assert "machine steady" in bench.noise([steady])["verdict"]
    nz = bench.noise([busy])
    assert nz["busy"] and "machine busy: ratios uncertain by ±40%" in nz["verdict"]


def test_noise_takes_each_half_gemm_yardstick_apart():
    """A bf16 GEMM (AMX) and an fp16 one (no AMX-FP16) differ 7× on a steady machine: their
    samples are spread per dtype, not pooled into one 'busy' verdict."""
    bf, fp = bench.Case("a", 1, 1, dtype="bfloat16"), bench.Case("b", 1, 1, dtype="float16")
    bf.results["lowp_gemm_samples"] = [2600e9, 2650e9, 2700e9]
    fp.results["lowp_gemm_samples"] = [370e9, 372e9, 375e9]
    nz = bench.noise([bf, fp])
    assert not nz["busy"] and nz["samples"] == 6, nz
    assert "bfloat16 GEMM yardstick" in nz["verdict"] and "float16 GEMM" in nz["verdict"]
    fp.results["lowp_gemm_samples"] = [370e9, 200e9, 375e9]
    assert bench.noise([bf, fp])["busy"]


def test_the_run_names_the_cpu_and_the_kernels_isa_level(tiny_run):
    """BENCHMARKS.md keeps one table per CPU: the run says which CPU (model name and family /
    model from /proc/cpuinfo where there is one) and which ISA level the kernel was built for."""
    out, _, data, _ = tiny_run
    from attnkit.backends.native import loader

    cpu = data["meta"]["cpu"]
    assert f"CPU: {cpu}\n" in out
    assert cpu.endswith(f"native kernel built for {loader.cpu_flags()[0]}"), cpu
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return
    assert cpu.startswith(name), (cpu, name)


def test_json_rows_are_flat_records_for_tracking(tiny_run):
    _, _, data, _ = tiny_run
    rows = data["rows"]
    names = [c.name for c in bench._cases("tiny")]
    assert {r["case"] for r in rows} == set(names)
    keys = {"case", "impl", "median_s", "ratio", "peer", "eff", "yardsticks", "date", "torch",
            "threads", "noise_pct"}
    for r in rows:
        assert keys <= set(r), set(keys) - set(r)
        assert r["torch"] == data["meta"]["torch"] and r["threads"] >= 1
        assert r["yardsticks"]["sgemm_flops"] > 0
        if r["impl"] == "attnkit":
            assert r["ratio"] == 1.0 and r["median_s"] > 0
        elif r["median_s"] is None:
            assert r["skipped"]
        else:
            assert r["ratio"] > 0 and r["peer"]
    impls = {(r["case"], r["impl"]) for r in rows}
    assert ("softcap fwd+bwd N=64", "baseline") in impls
    assert ("decode 1x256 D=16", "sdpa") in impls
    assert [r for r in rows if r["case"].startswith("decode")][0]["yardsticks"]["read_bw"] > 0


def test_the_low_precision_section_runs_sdpa_in_the_same_dtype(tiny_run, monkeypatch):
    """bf16 / fp16 cases (issue 21): SDPA gets the case's own dtype, the GEMM yardstick runs
    in it too (eff is of the matrix units' speed), and the header names both yardsticks."""
    out, _, data, _ = tiny_run
    assert re.search(r"^sgemm [\d.]+ GFLOP/s, bf16 GEMM [\d.]+ GFLOP/s, read", out, re.M)
    assert data["meta"]["yardsticks"]["bf16_gemm_flops"] > 0
    rows = {(r["case"], r["impl"]): r for r in data["rows"]}
    half = [c for c in bench._cases("tiny") if c.dtype != "float32"
            and not c.name.startswith("decode")]
    assert {c.dtype for c in half} == {"bfloat16", "float16"}
    for c in half:
        assert rows[(c.name, "attnkit")]["eff_of"] == f"{c.dtype} GEMM", c.name
        assert ("sdpa" in c.peers) == ((c.name, "sdpa") in rows), c.name
        assert f"(yardsticks in this case: {c.dtype} GEMM " in out
    assert ("bf16 causal fwd+bwd N=64", "sdpa") in rows
    assert ("bf16 soft-cap fwd N=64", "baseline") in rows
    assert rows[("decode 1x256 D=16 bf16", "sdpa")]["median_s"] > 0
    # what SDPA was handed: the case's dtype, not float32
    seen = []
    real = bench.F.scaled_dot_product_attention
    monkeypatch.setattr(bench.F, "scaled_dot_product_attention",
                        lambda q, *a, **kw: seen.append(q.dtype) or real(q, *a, **kw))
    case = next(c for c in bench._cases("tiny") if c.name == "fp16 causal fwd N=64")
    bench.run_case(case, 1e9, (None, "off"), naive_limit_gb=1.0)
    assert seen and set(seen) == {bench.torch.float16}


def test_plot_is_a_png(tiny_run):
    _, err, _, png = tiny_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in err


def test_list_prints_the_case_names(capsys):
    assert bench.run_cli(["--list", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    parsed = [re.split(r"\s{2,}", ln, maxsplit=1) for ln in lines]
    assert [p[0] for p in parsed] == [c.name for c in bench._cases("quick")]
    assert all("peers:" in p[1] for p in parsed)
    assert bench.run_cli(["--list", "--only", "softcap"]) == 0        # baselines come along
    names = [re.split(r"\s{2,}", ln)[0] for ln in capsys.readouterr().out.splitlines()]
    assert names == ["baseline causal fwd+bwd N=4096", "softcap fwd+bwd N=4096"]


def test_only_help_names_the_cases(capsys):
    with pytest.raises(SystemExit):
        bench.run_cli(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for c in bench._cases("full"):
        assert c.name in help_text
    assert "--list" in help_text and "--tiny" not in help_text


def test_only_matching_nothing_is_a_clear_error(capsys):
    assert bench.run_cli(["--tiny", "--only", "nosuchcase"]) == 2
    err = capsys.readouterr().err
    assert "matches no case" in err and "--list" in err


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path):
    real_import = builtins.__import__

    def no_mpl(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "x.png"
    assert bench.run_cli(["--tiny", "--plot", str(out)]) == 2       # before any case runs
    cap = capsys.readouterr()
    assert cap.out == ""
    err = cap.err.strip().splitlines()
    assert len(err) == 1
    assert "--plot needs matplotlib" in err[0] and 'pip install "attnkit[plot]"' in err[0]
    assert not out.exists()


def test_output_folder_must_exist(capsys, tmp_path):
    assert bench.run_cli(["--tiny", "--json", str(tmp_path / "no" / "b.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_outputs_never_replace_a_file_bench_did_not_write(capsys, tmp_path):
    """Checked before any case runs: a folder, one file for both outputs, a file that is not
    an earlier --json / --plot of bench (unless --force)."""
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    assert bench.run_cli(["--tiny", "--json", str(notes)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "is not JSON output of attnkit" in cap.err and "--force" in cap.err
    assert notes.read_text() == '{"mine": 1}'
    both = tmp_path / "b.png"
    assert bench.run_cli(["--tiny", "--json", str(both), "--plot", str(both)]) == 2
    assert "--json and --plot both name" in capsys.readouterr().err
    assert bench.run_cli(["--tiny", "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_an_earlier_bench_output_is_replaced(tiny_run, capsys, tmp_path):
    from attnkit._outfiles import looks_like

    _, _, records, png = tiny_run
    js = tmp_path / "old.json"
    js.write_text(json.dumps(records))
    assert looks_like(js, "json") and looks_like(png, "png")
    assert not looks_like(png, "json") and not looks_like(js, "png")


def test_peak_memory_run_is_apart_and_restores_the_timing_policy(monkeypatch):
    """The peak column comes from one untimed run under the RSS-following malloc policy; the
    timed runs go back to the warmed-up one (a fresh mapping per buffer slowed them)."""
    modes = []
    monkeypatch.setattr(bench, "_malloc_for", lambda peak: modes.append(peak))
    big = []
    assert bench._peak_once(lambda: big.append(bytearray(64 << 20))) >= 0.0
    assert modes == [True, False]
    modes.clear()
    t = bench.measure(lambda: None, repeat=3)
    assert t.runs == 3 and modes == [True, False]


def test_ab_trees_needs_two_source_trees(tmp_path):
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "ab_trees.py"
    one = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                         text=True)
    assert one.returncode == 2 and "two source trees" in one.stderr
    two = subprocess.run([sys.executable, str(script), str(tmp_path), str(tmp_path)],
                         capture_output=True, text=True)
    assert two.returncode == 2 and "has no src/attnkit" in two.stderr
    bad = subprocess.run([sys.executable, str(script), "a", "b", "--cases", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown case(s) nope" in bad.stderr


def test_bench_hotpath_arguments(tmp_path):
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hotpath.py"
    bad = subprocess.run([sys.executable, str(script), "--only", "nope"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "unknown case(s) nope" in bad.stderr
    one = subprocess.run([sys.executable, str(script), "--trees", str(tmp_path)],
                         capture_output=True, text=True)
    assert one.returncode == 2 and "two source trees" in one.stderr
    two = subprocess.run([sys.executable, str(script), "--trees", str(tmp_path), str(tmp_path)],
                         capture_output=True, text=True)
    assert two.returncode == 2 and "has no src/attnkit" in two.stderr
    reps = subprocess.run([sys.executable, str(script), "--reps", "0"], capture_output=True,
                          text=True)
    assert reps.returncode == 2 and "at least 1" in reps.stderr


def test_targets_are_judged_only_at_their_own_sizes():
    """A --quick run prints the values beside the targets without met / MISSED (the targets
    are set for the full sizes); a full-size run judges them; no internal tracker labels."""
    from attnkit import bench

    c = bench.Case("dense fwd N=4096", 4096, 4096)
    c.results["records"] = [{"impl": "attnkit", "eff": 0.5},
                            {"impl": "sdpa", "median_s": 1.0, "ratio": 0.5}]
    full = bench._summary([c], 5.0)
    assert any("MISSED" in line for line in full)
    quick = bench._summary([c], 5.0, judged=False)
    assert quick and all("MISSED" not in line and "met" not in line.split()[-1]
                         for line in quick)
    assert all("not judged" in line for line in quick)
    assert not any("issue" in what for _, _, _, what in bench._TARGETS)


def test_a_variants_baseline_is_timed_in_the_same_rounds(monkeypatch):
    """The baseline row of an option's case (soft-cap vs the plain causal call) is timed in
    the case's own rounds, alternating with the variant, and its ratio comes from those
    runs — not from the baseline case's own (earlier) timing."""
    import attnkit as ak

    calls: list[str] = []
    real = ak.attention

    def spy(*args, **kwargs):
        calls.append("softcap" if kwargs.get("softcap") else "plain")
        return real(*args, **kwargs)

    timed: list[str] = []
    fake = {"softcap": 2.0, "plain": 1.0, "other": 0.5}       # seconds per run, by call

    def fake_time(fn):
        n = len(calls)
        fn()
        timed.append(calls[-1] if len(calls) > n else "other")
        return fake[timed[-1]]

    monkeypatch.setattr(ak, "attention", spy)
    monkeypatch.setattr(bench, "_time_once", fake_time)
    small = {"d": 16, "heads": 2, "sgemm_n": 64, "repeat": 3, "mask": "causal", "peers": ()}
    base = bench.Case("causal fwd N=64", 64, 64, **small)
    base.results["timings"] = {"attnkit": bench.Timing(100.0, 0.0, 3)}   # stale: not used
    case = bench.Case("soft-cap fwd N=64", 64, 64, softcap=30.0, baseline=base.name, **small)
    bench.run_case(case, 1e9, (None, "off"), naive_limit_gb=1.5, baseline=base)
    assert timed == ["softcap", "plain", "other"] * 3           # variant, baseline, sgemm
    recs = {r["impl"]: r for r in case.results["records"]}
    assert recs["attnkit"]["median_s"] == 2.0
    assert recs["baseline"]["median_s"] == 1.0 and recs["baseline"]["ratio"] == 0.5
    assert recs["baseline"]["runs"] == 3
    assert "timed alternating with it" in recs["baseline"]["peer"]


def test_a_baseline_of_other_shapes_is_refused():
    base = bench.Case("causal fwd N=64", 64, 64, mask="causal")
    other = bench.Case("soft-cap fwd N=32", 32, 32, softcap=30.0, baseline=base.name)
    import torch

    q = torch.zeros(1, 8, 32, 64)
    with pytest.raises(ValueError, match="differs in more than"):
        bench._baseline_inputs(other, base, q, q, q)
