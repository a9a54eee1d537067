"""The cost model of one transformer layer: parameters, forward FLOPs, KV-cache bytes.

The closed-form formulas of the course, for one layer (attention block + feed-forward)::

    d = d_model   H = n_heads   h = d / H (head width)   n = seq_len   m = ffn_mult
    H_kv = n_kv_heads   d_c = kv_latent_dim   b = bytes per element

    parameters (weights only; biases and norm gains are not counted)
      attention, MHA          4d²                      W_Q, W_K, W_V, W_O: d×d each
      attention, GQA / MQA    2d² + 2·d·(H_kv·h)       W_K, W_V shrink to d×(H_kv·h)
      attention, MLA          2d² + 3·d·d_c            W_Q, W_O; W_DKV d×d_c; W_UK, W_UV d_c×d
      FFN                     2·m·d²                   d→m·d→d  (m = 4: 8d²)

    forward FLOPs for one sequence of n tokens (a multiply-add = 2 FLOPs)
      projections, MHA        8nd²                     4 matmuls (n×d)·(d×d)
      projections, GQA / MQA  4nd² + 4nd·(H_kv·h)
      projections, MLA        4nd² + 6nd·d_c           (plain path: K, V up-projected)
      scores + mixing         4n²d                     QKᵀ 2n²d, weights·V 2n²d (all variants)
      FFN                     4·m·nd²                  (m = 4: 16nd²)
      attention subtotal      8nd² + 4n²d (MHA)        next to the FFN's: (2 + n/d)/m of it

    KV cache (one layer)
      per token               MHA 2·d·b   GQA 2·H_kv·h·b   MQA 2·h·b   MLA d_c·b
      whole sequence          per token × n × batch

FLOPs scale with ``batch``; parameter counts do not. ``report(...)`` evaluates every row and
prints a table whose rows name their formula; ``run_cli`` is the ``attnkit cost`` command.

Caution
-------
- Counts are per layer; multiply by the number of layers for a model. Softmax, masking,
  norms, biases and activations are left out (they are O(n·d) or O(n²·H), small next to the
  matmuls).
- The MLA FLOPs are the plain path's; the absorbed decode path trades the K/V up-projection
  for scores against the d_c-wide latent.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

__all__ = ["CostReport", "Row", "report", "run_cli"]


@dataclass(frozen=True)
class Row:
    """One line of the report: what it counts, the formula, and its value."""

    section: str      # "parameters" | "forward FLOPs" | "KV cache"
    name: str         # e.g. "attention, GQA (H_kv=8)"
    formula: str      # e.g. "2d² + 2·d·(H_kv·h)"
    value: int
    unit: str         # "params" | "FLOP" | "B"


def _human(x: int, unit: str) -> str:
    if unit == "B":
        for u, s in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if x >= s:
                return f"{x / s:.2f} {u}"
        return f"{x} B"
    for u, s in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if x >= s:
            return f"{x / s:.2f} {u}"
    return str(x)


def _int(x: object, name: str, minimum: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {x!r}")
    return x


@dataclass
class CostReport:
    """Parameters, forward FLOPs and KV-cache bytes of one layer (see the module docstring).

    The dict fields are keyed by variant: ``"MHA"``, ``"MQA"`` always, ``"GQA"`` when
    ``n_kv_heads`` is given (and strictly between 1 and ``n_heads``), ``"MLA"`` when
    ``kv_latent_dim`` is given. ``str(report)`` is the table; ``to_dict()`` is JSON-ready.
    """

    d_model: int
    n_heads: int
    seq_len: int
    n_kv_heads: int | None = None
    kv_latent_dim: int | None = None
    ffn_mult: int = 4
    batch: int = 1
    dtype_bytes: int = 2
    head_dim: int = field(init=False)
    attn_params: dict[str, int] = field(init=False)
    ffn_params: int = field(init=False)
    proj_flops: dict[str, int] = field(init=False)
    core_flops: int = field(init=False)
    ffn_flops: int = field(init=False)
    kv_bytes_per_token: dict[str, int] = field(init=False)
    kv_bytes: dict[str, int] = field(init=False)
    rows: list[Row] = field(init=False)

    def __post_init__(self) -> None:
        d = _int(self.d_model, "d_model")
        H = _int(self.n_heads, "n_heads")
        n = _int(self.seq_len, "seq_len", 0)
        m = _int(self.ffn_mult, "ffn_mult")
        batch = _int(self.batch, "batch")
        b = _int(self.dtype_bytes, "dtype_bytes")
        if d % H:
            raise ValueError(f"d_model={d} is not divisible by n_heads={H}: the head width "
                             f"h = d_model / n_heads must be an integer")
        h = self.head_dim = d // H
        variants: dict[str, tuple[str, int | None]] = {"MHA": ("", H)}
        if self.n_kv_heads is not None:
            kv = _int(self.n_kv_heads, "n_kv_heads")
            if H % kv:
                raise ValueError(f"n_heads={H} must be a multiple of n_kv_heads={kv}: use a "
                                 f"divisor of {H}")
            if 1 < kv < H:
                variants["GQA"] = (f" (H_kv={kv})", kv)
        variants["MQA"] = (" (H_kv=1)", 1)
        if self.kv_latent_dim is not None:
            variants["MLA"] = (f" (d_c={_int(self.kv_latent_dim, 'kv_latent_dim')})", None)
        d_c = self.kv_latent_dim or 0

        self.attn_params, self.proj_flops, self.kv_bytes_per_token = {}, {}, {}
        p_rows, f_rows, k_rows = [], [], []
        for name, (tag, kv) in variants.items():
            if name == "MHA":
                params, pf = 4 * d * d, "4d²"
                flops, ff = 8 * n * d * d, "8nd²"
                tok, tf = 2 * d * b, "2·d·b"
            elif name == "MLA":
                params, pf = 2 * d * d + 3 * d * d_c, "2d² + 3·d·d_c"
                flops, ff = 4 * n * d * d + 6 * n * d * d_c, "4nd² + 6nd·d_c"
                tok, tf = d_c * b, "d_c·b"
            else:
                assert kv is not None
                params, pf = 2 * d * d + 2 * d * (kv * h), "2d² + 2·d·(H_kv·h)"
                flops, ff = 4 * n * d * d + 4 * n * d * (kv * h), "4nd² + 4nd·(H_kv·h)"
                tok, tf = 2 * kv * h * b, "2·H_kv·h·b"
            self.attn_params[name] = params
            self.proj_flops[name] = flops * batch
            self.kv_bytes_per_token[name] = tok
            p_rows.append(Row("parameters", f"attention, {name}{tag}", pf, params, "params"))
            f_rows.append(Row("forward FLOPs", f"projections, {name}{tag}",
                              ff + (" × batch" if batch > 1 else ""), flops * batch, "FLOP"))
            k_rows.append(Row("KV cache", f"per token, {name}{tag}", tf, tok, "B"))
        self.kv_bytes = {k: v * n * batch for k, v in self.kv_bytes_per_token.items()}
        self.ffn_params = 2 * m * d * d
        self.core_flops = 4 * n * n * d * batch
        self.ffn_flops = 4 * m * n * d * d * batch
        xb = " × batch" if batch > 1 else ""
        p_rows.append(Row("parameters", f"FFN (d→{m}d→d)", f"2·m·d² = {2 * m}d²",
                          self.ffn_params, "params"))
        p_rows.append(Row("parameters", "layer total, MHA", f"4d² + {2 * m}d²",
                          self.attn_params["MHA"] + self.ffn_params, "params"))
        f_rows.append(Row("forward FLOPs", "scores + mixing (every variant)", "4n²d" + xb,
                          self.core_flops, "FLOP"))
        f_rows.append(Row("forward FLOPs", "attention subtotal, MHA", "8nd² + 4n²d" + xb,
                          self.proj_flops["MHA"] + self.core_flops, "FLOP"))
        f_rows.append(Row("forward FLOPs", f"FFN (d→{m}d→d)", f"4·m·nd² = {4 * m}nd²" + xb,
                          self.ffn_flops, "FLOP"))
        f_rows.append(Row("forward FLOPs", "layer total, MHA",
                          f"{8 + 4 * m}nd² + 4n²d" + xb,
                          self.proj_flops["MHA"] + self.core_flops + self.ffn_flops, "FLOP"))
        for name, (tag, _) in variants.items():
            k_rows.append(Row("KV cache", f"sequence, {name}{tag}",
                              "per token × n" + xb, self.kv_bytes[name], "B"))
        self.rows = p_rows + f_rows + k_rows

    @property
    def attention_flops(self) -> dict[str, int]:
        """Forward FLOPs of the attention block per variant (projections + scores + mixing):
        MHA 8nd² + 4n²d, next to the FFN's 4·m·nd² (:attr:`ffn_flops`)."""
        return {k: v + self.core_flops for k, v in self.proj_flops.items()}

    @property
    def flops(self) -> dict[str, int]:
        """Forward FLOPs of the whole layer per variant (projections + scores + FFN)."""
        return {k: v + self.core_flops + self.ffn_flops for k, v in self.proj_flops.items()}

    def to_dict(self) -> dict:
        out = asdict(self)
        out["rows"] = [asdict(r) for r in self.rows]
        out["flops"] = self.flops
        out["attention_flops"] = self.attention_flops
        return out

    def __str__(self) -> str:
        head = (f"attnkit cost — one layer: d = d_model = {self.d_model}, H = {self.n_heads} "
                f"heads (h = d/H = {self.head_dim}), n = seq_len = {self.seq_len}, "
                f"batch = {self.batch}, b = {self.dtype_bytes} bytes/element, "
                f"m = ffn_mult = {self.ffn_mult}")
        if self.kv_latent_dim is not None:
            head += f", d_c = {self.kv_latent_dim}"
        notes = ("weights only (no biases / norms); a multiply-add = 2 FLOPs; "
                 "MLA FLOPs: plain path")
        w_name = max(len(r.name) for r in self.rows)
        w_form = max(len(r.formula) for r in self.rows)
        w_val = max(len(f"{r.value:,}") for r in self.rows)
        lines = [head, notes]
        section = None
        for r in self.rows:
            if r.section != section:
                section = r.section
                lines += ["", f"{section}:",
                          f"  {'':<{w_name}}  {'formula':<{w_form}}  {'exact':>{w_val}}"]
            lines.append(f"  {r.name:<{w_name}}  {r.formula:<{w_form}}  {r.value:>{w_val},}  "
                         f"{_human(r.value, r.unit)}" + ("" if r.unit == "B" else f" {r.unit}"))
        att, ffn = self.attention_flops["MHA"], self.ffn_flops
        if ffn:
            lines += ["", f"attention / FFN forward FLOPs (MHA): (8nd² + 4n²d) / "
                      f"{4 * self.ffn_mult}nd² = (2 + n/d) / {self.ffn_mult} = "
                      f"{att / ffn:.2f} — attention costs more than the FFN once n > "
                      f"{self.ffn_mult - 2}·d" if self.ffn_mult > 2 else
                      f"attention / FFN forward FLOPs (MHA) = {att / ffn:.2f}"]
        return "\n".join(lines) + "\n"


def report(
    d_model: int,
    n_heads: int,
    seq_len: int,
    n_kv_heads: int | None = None,
    kv_latent_dim: int | None = None,
    ffn_mult: int = 4,
    batch: int = 1,
    dtype_bytes: int = 2,
) -> CostReport:
    """Parameters, forward FLOPs and KV-cache bytes of one layer; ``print()`` it for a table.

    Example: ``print(attnkit.cost.report(4096, 32, 8192, n_kv_heads=8))``.
    """
    return CostReport(d_model, n_heads, seq_len, n_kv_heads=n_kv_heads,
                      kv_latent_dim=kv_latent_dim, ffn_mult=ffn_mult, batch=batch,
                      dtype_bytes=dtype_bytes)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


_DTYPES = {"float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float32": 4, "fp32": 4,
           "float8": 1, "fp8": 1, "int8": 1}


def run_cli(argv: list[str]) -> int:
    """``attnkit cost --d-model 4096 --heads 32 --kv-heads 8 --seq 8192``: print the table.

    Returns the exit status: 0, or 2 with one ``attnkit cost: error: ...`` line on stderr.
    """
    parser = _Parser(prog="attnkit cost",
                     description="parameters, forward FLOPs and KV-cache bytes of one layer")
    parser.add_argument("--d-model", type=int, required=True, help="model width d")
    parser.add_argument("--heads", type=int, required=True, help="query heads H")
    parser.add_argument("--seq", type=int, required=True, help="sequence length n")
    parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA)")
    parser.add_argument("--kv-latent", type=int, default=None, help="MLA latent width d_c")
    parser.add_argument("--ffn-mult", type=int, default=4, help="FFN width multiple (4)")
    parser.add_argument("--batch", type=int, default=1,
                        help="sequences at once (scales FLOPs and KV-cache bytes)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES),
                        help="element type of the KV cache (bfloat16)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    try:
        args = parser.parse_args(argv)
        r = report(args.d_model, args.heads, args.seq, n_kv_heads=args.kv_heads,
                   kv_latent_dim=args.kv_latent, ffn_mult=args.ffn_mult, batch=args.batch,
                   dtype_bytes=_DTYPES[args.dtype])
    except (_UsageError, ValueError) as e:
        sys.stderr.write(f"attnkit cost: error: {e}\n")
        return 2
    except SystemExit as e:          # --help
        return int(e.code or 0)
    sys.stdout.write(json.dumps(r.to_dict(), indent=2) + "\n" if args.json else str(r))
    return 0
