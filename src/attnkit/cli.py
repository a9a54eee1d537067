"""The ``attnkit`` command line (also ``python -m attnkit``).

    attnkit explain                       the default worked example (three tokens, causal)
    attnkit explain --example NAME        a built-in example (``attnkit examples`` lists them)
    attnkit explain --q Q --k K --v V     your own inputs (.npy, .json or .csv)
          [--causal | --mask FILE] [--scale X] [--softcap C] [--heads N]
          [--lang en|ko] [--html OUT.html] [--plot OUT.png] [--force]
    attnkit explain --model minilm [--text "..."] [--layer L --head H --token T]
          [--pad-to N] [--lang] [--html] [--plot] [--force]
                                          a real model's attention (every layer × head)
    attnkit explain --model tiny-ko [--text "..."] [--lang ko] [--html]
                                          a tiny Korean causal model trained here: its
                                          heads, then its next-token probabilities
    attnkit train-tiny [--retrain] [--lang]
                                          train (once, ~15 s) and cache tiny-ko
    attnkit examples [--lang ko]          the built-in examples, one per line (then where
                                          the lessons and the course notebooks are)
    attnkit lesson [NAME] [--lang] [--plot OUT.png] [--force]
                                          a lesson: sqrt-dk, bounds, attn-vs-ffn, heads
    attnkit --version                     the installed version
    attnkit bench ... / attnkit cost ...  handed to attnkit.bench / attnkit.cost

Bad input (an unreadable file, shapes that don't fit, an unknown example) prints one line
on stderr — the file, the shapes seen and what would fit — and exits with status 2.

Outputs (``--html``, ``--plot``) are checked before any work: never an input file, never
one file for two outputs, and an existing file only when it is an earlier attnkit output of
that kind (a page, a PNG) — anything else needs ``--force`` (see ``attnkit._outfiles``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from ._outfiles import output_problem
from .explain.examples import DEFAULT, EXAMPLES, with_overrides
from .explain.guard import ExplainError
from .explain.inputs import InputError, finite_number, parse_labels, prepare_inputs
from .explain.strings import LANGS
from .explain.text import render_many

if TYPE_CHECKING:
    from .explain.trace import Trace

__all__ = ["main"]

DELEGATED = {"bench": "run the benchmarks (attnkit.bench)",
             "cost": "parameters, FLOPs, bytes and KV-cache size (attnkit.cost)"}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (raised, so main can exit 2 cleanly)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _build_parser() -> _Parser:
    parser = _Parser(prog="attnkit", description="Attention, explained: "
                     "O = softmax(Q Kᵀ · scale + M) V, step by step.")
    parser.add_argument("--version", action="version", version=f"attnkit {_version()}")
    sub = parser.add_subparsers(dest="cmd",
                                metavar="{explain,examples,lesson,train-tiny,bench,cost}")
    ex = sub.add_parser("explain", help="walk through an attention call step by step",
                        description="Walk through softmax(Q Kᵀ · scale + M) V step by step. "
                        "Without --q: a built-in example (default: three tokens, causal).")
    ex.add_argument("--example", metavar="NAME",
                    help=f"a built-in example (default {DEFAULT}); see `attnkit examples`")
    ex.add_argument("--q", metavar="FILE", help="queries (n_q, d_k): .npy, .json or .csv")
    ex.add_argument("--k", metavar="FILE", help="keys (n_k, d_k); default: the --q file")
    ex.add_argument("--v", metavar="FILE", help="values (n_k, d_v); default: the --k file")
    ex.add_argument("--causal", action="store_true", help="query i sees keys 1..i only")
    ex.add_argument("--mask", metavar="FILE",
                    help="(n_q, n_k) mask: true/false (true = may attend) or 0/-inf")
    ex.add_argument("--scale", type=float, help="multiplies the scores (default 1/√d_k)")
    ex.add_argument("--softcap", type=float, metavar="C", help="logit x → C·tanh(x/C)")
    ex.add_argument("--heads", type=int, metavar="N",
                    help="split the feature width into N heads")
    ex.add_argument("--q-labels", metavar="A,B,..", help="word labels for the query rows")
    ex.add_argument("--k-labels", metavar="A,B,..", help="word labels for the key columns")
    ex.add_argument("--lang", choices=LANGS, default="en", help="language (default en)")
    ex.add_argument("--decimals", type=int, default=3, help="decimal places (default 3)")
    ex.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                    help="terminal colour (default: only on a terminal)")
    ex.add_argument("--html", metavar="OUT.html", help="also write a self-contained HTML page")
    ex.add_argument("--plot", metavar="OUT.png", help="also write heatmaps of the weights")
    ex.add_argument("--force", action="store_true",
                    help="replace an existing --html / --plot file that attnkit did not write")
    ex.add_argument("--plot-steps", metavar="LIST", default="weights",
                    help="what --plot draws, comma-separated from scores, scaled, logits, "
                         "weights (default weights)")
    ex.add_argument("--model", metavar="NAME_OR_PATH",
                    help="'minilm' (built in, offline), 'tiny-ko' (a Korean character model "
                    "trained here: attnkit train-tiny) or a folder with a Hugging Face model")
    ex.add_argument("--text", help="with --model: the text (default: the course's pronoun "
                    "sentence)")
    ex.add_argument("--layer", type=int, help="with --model: the layer to walk through (from 1)")
    ex.add_argument("--head", type=int, help="with --model: the head to walk through (from 1)")
    ex.add_argument("--token", help="with --model: the query token (a token, or its position "
                    "from 1)")
    ex.add_argument("--pad-to", type=int, metavar="N",
                    help="with --model: pad the text to N tokens (shows the padding mask)")
    from .explain.lessons import LESSONS

    les = sub.add_parser("lesson", help="a built-in lesson (measured or drawn)",
                         description="A built-in lesson: " + ", ".join(LESSONS))
    les.add_argument("name", nargs="?", metavar="NAME",     # checked in _lesson, in --lang
                     help="one of " + ", ".join(LESSONS) + " (none: list them)")
    les.add_argument("--lang", choices=LANGS, default="en", help="language (default en)")
    les.add_argument("--plot", metavar="OUT.png", help="also draw the lesson's figure")
    les.add_argument("--force", action="store_true",
                     help="replace an existing --plot file that attnkit did not write")
    tt = sub.add_parser("train-tiny", help="train the tiny Korean model tiny-ko (once; cached)",
                        description="Train tiny-ko, a character-level causal Transformer built "
                        "from attnkit's layers, on the Korean text about Attention that ships "
                        "with attnkit (seeded: the same weights every time), and cache it. "
                        "Then: attnkit explain --model tiny-ko --lang ko --html tiny.html")
    tt.add_argument("--retrain", action="store_true", help="train again even when cached")
    tt.add_argument("--lang", choices=LANGS, default="en", help="language (default en)")
    exs = sub.add_parser("examples", help="list the built-in examples (and where the lessons "
                         "and notebooks are)")
    exs.add_argument("--lang", choices=LANGS, default="en", help="language (default en)")
    for name, text in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _version() -> str:
    """The installed distribution's version (importlib.metadata), else the package's own."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attnkit")
    except PackageNotFoundError:                  # running from a source tree, not installed
        from . import __version__

        return __version__


def _model(args: argparse.Namespace) -> int:
    """``attnkit explain --model``: a real model's attention, as text (and --html, --plot)."""
    from .explain.model import ModelError, ModelWarning, explain_model

    given = [f"--{n}" for n in ("example", "q", "k", "v", "mask", "heads", "scale", "softcap")
             if getattr(args, n) is not None] + (["--causal"] if args.causal else [])
    if given:
        raise InputError("model_only", opts=", ".join(given))
    _check_outputs(args)
    if not _tiny_first(args):                     # tiny-ko needs no transformers
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()     # no "Loading weights" bar on the terminal
        except ImportError:
            pass
    try:
        with warnings.catch_warnings():     # the text below says it, in --lang, once
            warnings.simplefilter("ignore", ModelWarning)
            mt = explain_model(args.model, args.text, layer=args.layer, head=args.head,
                               token=args.token, pad_to=args.pad_to)
        sys.stdout.write(mt.to_text(args.lang, decimals=args.decimals))
        sys.stdout.flush()
        if args.html:
            mt.to_html(args.html, lang=args.lang)
            print(f"attnkit: wrote {args.html}", file=sys.stderr)
        if args.plot:
            _noting("explain", mt.plot, args.plot, lang=args.lang)
            print(f"attnkit: wrote {args.plot}", file=sys.stderr)
    except ModelError as e:
        print(f"attnkit explain: {e}", file=sys.stderr)
        return 2
    return 0


def _train_tiny(args: argparse.Namespace) -> int:
    """``attnkit train-tiny``: train tiny-ko (with a progress bar) and cache it."""
    import time

    from .explain import tiny
    from .explain.strings import STRINGS

    t = STRINGS[args.lang]
    cfg, path = tiny.TinyConfig(), tiny.cache_path()
    if not args.retrain and tiny.cached(cfg) is not None:
        print(t["tt_cached"].format(name=tiny.NAME, path=path), file=sys.stderr)
        return 0
    print(t["tt_training"].format(name=tiny.NAME, steps=cfg.steps, path=path), file=sys.stderr)
    start = time.perf_counter()
    _, _, losses, _ = tiny.load_or_train(cfg, progress=sys.stderr, retrain=True)
    print(t["tt_done"].format(name=tiny.NAME, s=f"{time.perf_counter() - start:.1f}",
                              a=f"{losses[0]:.2f}", b=f"{sum(losses[-10:]) / 10:.2f}",
                              path=path), file=sys.stderr)
    return 0


def _tiny_first(args: argparse.Namespace) -> bool:
    """Whether ``--model`` is tiny-ko; before it is trained (the first time), say so in
    --lang."""
    from .explain import tiny
    from .explain.strings import STRINGS

    if str(args.model).lower() != tiny.NAME:
        return False
    if tiny.cached() is None:
        print(STRINGS[args.lang]["tt_training"].format(
            name=tiny.NAME, steps=tiny.TinyConfig().steps, path=tiny.cache_path()),
            file=sys.stderr)
    return True


def _delegate(name: str, rest: list[str]) -> int:
    """``attnkit bench ...`` → ``attnkit.bench.run_cli(rest)`` (imported only now)."""
    try:
        run_cli = importlib.import_module(f"attnkit.{name}").run_cli
    except (ImportError, AttributeError) as e:
        print(f"attnkit {name}: not available in this install "
              f"({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    rc = run_cli(rest)
    return int(rc) if rc is not None else 0


def _examples(args: argparse.Namespace) -> int:
    """The examples, one a line; then, after a blank line, where the lessons and the
    notebooks are."""
    from .explain.lessons import LESSONS
    from .explain.strings import STRINGS

    width = max(len(n) for n in EXAMPLES)
    for name, ex in EXAMPLES.items():
        print(f"{name.ljust(width)}  {ex.describe(args.lang)}")
    print("\n" + STRINGS[args.lang]["ex_more"].format(lessons=", ".join(LESSONS)))
    return 0


def _noting(cmd: str, draw: Callable[..., Any], *a: Any, **kw: Any) -> Any:
    """Draw a figure; its warnings (e.g. no font with Hangul) become one note each on
    stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = draw(*a, **kw)
    for msg in dict.fromkeys(" ".join(str(w.message).split()) for w in caught):
        print(f"attnkit {cmd}: note: {msg}", file=sys.stderr)
    return out


def _lesson(args: argparse.Namespace) -> int:
    from .explain.lessons import LESSONS

    if args.name is None:                  # `attnkit lesson`: the list
        width = max(len(n) for n in LESSONS)
        for name, les in LESSONS.items():
            print(f"{name.ljust(width)}  {les.describe(args.lang)}")
        return 0
    if args.name not in LESSONS:
        raise InputError("unknown_lesson", name=args.name, names=", ".join(LESSONS))
    lesson = LESSONS[args.name]
    if args.plot:
        _check_outputs(args)
        if lesson.make_plot is None:
            raise InputError("lesson_no_plot", name=args.name)
    sys.stdout.write(lesson.text(args.lang))
    if args.plot:
        _noting("lesson", lesson.plot, args.plot, args.lang)
        print(f"attnkit: wrote {args.plot}", file=sys.stderr)
    return 0


def _traces(args: argparse.Namespace) -> list[Trace]:
    from .explain.trace import explain

    scale = finite_number(args.scale, "scale") if args.scale is not None else None
    softcap = finite_number(args.softcap, "softcap") if args.softcap is not None else None
    if args.q is None:
        own = [f"--{n}" for n in ("k", "v", "mask", "heads", "q_labels", "k_labels")
               if getattr(args, n) is not None] + (["--causal"] if args.causal else [])
        if own:
            raise InputError("own_only", opts=", ".join(o.replace("_", "-") for o in own))
        name = args.example or DEFAULT
        if name not in EXAMPLES:
            raise InputError("unknown_example", name=name, names=", ".join(EXAMPLES))
        return with_overrides(EXAMPLES[name].traces(), scale, softcap)
    if args.example is not None:
        raise InputError("example_and_q")
    inp = prepare_inputs(args.q, args.k, args.v, mask_path=args.mask, heads=args.heads,
                         causal=args.causal)
    tr = explain(inp.q, inp.k, inp.v, mask=inp.mask, is_causal=args.causal, scale=scale,
                 softcap=softcap)
    tr.labelled(parse_labels(args.q_labels, inp.q.shape[-2], "q"),
                parse_labels(args.k_labels, inp.k.shape[-2], "k"))
    return [tr]


def _check_output(path: str | None, key: str) -> None:
    """Fail before any work when an output path cannot be written (missing folder, a folder)."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise InputError(key, path=path, err="it is a directory")
    if not os.path.isdir(parent):
        raise InputError(key, path=path, err=f"the folder {parent} does not exist")


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output option (--html, --plot) before any work: writable, not an input file,
    not the file of another output, and not an existing file attnkit did not write (unless
    --force)."""
    outputs = [("--html", getattr(args, "html", None), "html", "write_html"),
               ("--plot", getattr(args, "plot", None), "png", "write_plot")]
    inputs = [(f"--{n}", getattr(args, n, None)) for n in ("q", "k", "v", "mask")]
    earlier: list[tuple[str, str | None]] = []
    for flag, path, kind, key in outputs:
        _check_output(path, key)
        problem = output_problem(flag, path, kind, inputs=inputs, earlier=earlier,
                                 force=getattr(args, "force", False))
        if problem is not None:
            raise InputError(problem[0], **problem[1])
        earlier.append((flag, path))


def _explain(args: argparse.Namespace) -> int:
    if args.decimals < 0 or args.decimals > 12:
        raise InputError("decimals", d=args.decimals)
    if args.model is not None:
        return _model(args)
    used = [f"--{n.replace('_', '-')}" for n in ("text", "layer", "head", "token", "pad_to")
            if getattr(args, n) is not None]
    if used:
        raise InputError("needs_model", opts=", ".join(used))
    from .explain.plot import WHAT

    plot_what = tuple(w.strip() for w in args.plot_steps.split(",") if w.strip())
    if not plot_what or any(w not in WHAT for w in plot_what):
        raise InputError("plot_steps", given=args.plot_steps, choices=", ".join(WHAT))
    _check_output(args.html, "write_html")
    _check_output(args.plot, "write_plot")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise InputError("plot_ext", path=args.plot)
    _check_outputs(args)
    try:
        traces = _traces(args)
    except (InputError, ExplainError):
        raise
    except (ValueError, TypeError) as e:      # the API's own checks (shapes, options)
        files = ", ".join(f"--{n} {getattr(args, n)}" for n in ("q", "k", "v", "mask")
                          if getattr(args, n, None))
        raise InputError("api", msg=e, files=f" [{files}]" if files else "") from None
    color = {"auto": None, "always": True, "never": False}[args.color]
    sys.stdout.write(render_many(traces, lang=args.lang, decimals=args.decimals, color=color))
    sys.stdout.flush()
    if args.html:
        from .explain.html import render_html

        page = render_html(traces, lang=args.lang)
        try:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(page)
        except OSError as e:
            raise InputError("write_html", path=args.html, err=e.strerror or e) from None
        print(f"attnkit: wrote {args.html}", file=sys.stderr)
    if args.plot:
        try:
            from .explain.plot import render_plot

            _noting("explain", render_plot, traces, args.plot, what=plot_what, lang=args.lang)
        except ImportError as e:
            raise InputError("needs_mpl", err=e) from None
        except OSError as e:
            raise InputError("write_plot", path=args.plot, err=e.strerror or e) from None
        print(f"attnkit: wrote {args.plot}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    lang, args = "en", None
    try:
        args = _build_parser().parse_args(argv)
        lang = getattr(args, "lang", "en")
        if args.cmd == "examples":
            return _examples(args)
        if args.cmd == "lesson":
            return _lesson(args)
        if args.cmd == "train-tiny":
            return _train_tiny(args)
        if args.cmd is None:            # bare `attnkit`: the default example
            args = _build_parser().parse_args(["explain"])
        return _explain(args)
    except _UsageError as e:
        print(" ".join(str(e).split("\n")), file=sys.stderr)
        return 2
    except (InputError, ExplainError) as e:
        cmd = "lesson" if getattr(args, "cmd", None) == "lesson" else "explain"
        print(f"attnkit {cmd}: " + e.message(lang), file=sys.stderr)
        return 2
    except BrokenPipeError:             # `attnkit explain | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
