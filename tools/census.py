"""`oracle census expf`: every float32 input through an exp implementation, against the canonical expf.

For each implementation it counts, over the 2^32 inputs (or a `--range` of bit patterns):

* results whose bits differ from `oracle.numerics.expf` (NaN results too: their bits are compared);
* results that still differ after rounding both to BF16 (what a BF16 activation would see);
* differing results in softmax's range, x <= 0 (every argument of softmax's exp is `s - max`);
* the largest ULP distance (f32, between non-NaN results) and the first differing input.

Implementations (`--engine numba`, the default, runs the first four; `--engine cpu|cuda` adds the
engine's own canonical expf):

    libm        the platform's expf, called through ctypes from Numba (glibc >= 2.28 with FMA: 0)
    numpy       NumPy's float32 np.exp (its own SIMD algorithm)
    cephes-poly a "fast intrinsic": Cephes-style range reduction and a degree-5 polynomial, no table
    schraudolph the classic bit trick (one multiply-add into the exponent field)
    oracle      oracle.numerics.expf, computed again inside the counting loop (0: a control of the harness)
    cpu         fast._core.expf (the C++ canonical expf), plus the extension's own exhaustive loops
                expf_check_range / expf_avx2_check_range against libm
    cuda        fast._cuda.expf, when the CUDA extension is built

The loop runs in blocks of 2^22 inputs, each block in Numba `parallel=True` kernels
(tools/census_kernels.py, imported on first use so that the CLI starts without Numba).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

BLOCK = 1 << 22          # inputs per progress step

# -- the census --------------------------------------------------------------------------------------

@dataclass
class Impl:
    name: str
    about: str
    fused: int | None = None                 # index into fused_block
    array: object = None                     # f32 array -> f32 array
    range_check: object = None               # (lo, hi) -> (mismatches, first) against libm (C++ loops)


@dataclass
class Result:
    name: str
    about: str
    inputs: int = 0
    differ: int = 0
    differ_bf16: int = 0
    differ_softmax: int = 0
    softmax_inputs: int = 0
    max_ulps: int = 0
    first: int | None = None
    seconds: float = 0.0
    against: str = "oracle.numerics.expf"
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("name", "about", "against", "inputs", "differ", "differ_bf16",
                                           "differ_softmax", "softmax_inputs", "max_ulps", "seconds")}
        d["first"] = None if self.first is None else f"0x{self.first:08x}"
        d["first_value"] = None if self.first is None else float(np.uint32(self.first).view(np.float32))
        d["seconds"] = round(self.seconds, 3)
        return d


def implementations(engine: str = "numba", only=None) -> list[Impl]:
    impls = [
        Impl("libm", "platform libm expf via ctypes (glibc >= 2.28 FMA build: the canonical algorithm)", fused=0),
        Impl("numpy", "NumPy float32 np.exp (its own SIMD algorithm)", array=np.exp),
        Impl("cephes-poly", "fast intrinsic: Cephes range reduction + degree-5 polynomial, f32, no table", fused=1),
        Impl("schraudolph", "bit trick: a*x + b written into the exponent field", fused=2),
    ]
    if engine == "numba":
        impls.append(Impl("oracle", "oracle.numerics.expf through a second code path (control)", fused=3))
    elif engine == "cpu":
        try:
            import fast._core as core
        except ImportError as e:
            raise ValueError(f"--engine cpu: the C++ extension fast._core is not available ({e})") from None
        if hasattr(core, "expf"):
            impls.append(Impl("cpu", "fast._core.expf: the C++ canonical expf on arrays", array=core.expf))
        if hasattr(core, "expf_check_range"):
            impls.append(Impl("cpu-scalar-vs-libm", "fast._core.expf_check_range: C++ scalar expf vs libm, "
                              "its own loop", range_check=core.expf_check_range))
        if hasattr(core, "expf_avx2_check_range"):
            impls.append(Impl("cpu-avx2-vs-libm", "fast._core.expf_avx2_check_range: 8-wide AVX2 expf vs libm",
                              range_check=core.expf_avx2_check_range))
        if len(impls) == 4:
            raise ValueError("--engine cpu: fast._core has no expf functions")
    elif engine == "cuda":
        try:
            import fast._cuda as cu
        except ImportError as e:
            raise ValueError(f"--engine cuda: the CUDA extension fast._cuda is not available ({e})") from None
        if not hasattr(cu, "expf"):
            raise ValueError("--engine cuda: fast._cuda has no expf(array) function")
        impls.append(Impl("cuda", "fast._cuda.expf: the CUDA canonical expf", array=cu.expf))
    else:
        raise ValueError(f"--engine {engine!r}: expected numba, cpu or cuda")
    if only:
        names = {i.name for i in impls}
        unknown = sorted(set(only) - names)
        if unknown:
            raise ValueError(f"--only: unknown implementation(s) {unknown}; this engine has {sorted(names)}")
        impls = [i for i in impls if i.name in only]
    return impls


def census_expf(lo: int = 0, hi: int = 1 << 32, engine: str = "numba", only=None, progress=None,
                impls: list[Impl] | None = None) -> list[Result]:
    """Run the census over input bit patterns [lo, hi). progress(done_inputs) is called after each block."""
    if not 0 <= lo < hi <= 1 << 32:
        raise ValueError(f"range [{lo:#x}, {hi:#x}) is not inside [0, 2^32)")
    from .census_kernels import SUB, canonical_block, compare_block, fused_block, libm_block
    impls = impls if impls is not None else implementations(engine, only)
    results = [Result(i.name, i.about, against="host libm (C++ loop)" if i.range_check else "oracle.numerics.expf")
               for i in impls]
    canon = np.empty(min(BLOCK, hi - lo), np.uint32)
    nsub = (canon.size + SUB - 1) // SUB
    stats = np.zeros((nsub, 6), np.int64)
    for start in range(lo, hi, BLOCK):
        n = min(BLOCK, hi - start)
        c = canon[:n]
        need_canon = any(i.range_check is None for i in impls)
        if need_canon:
            canonical_block(np.int64(start), n, c)
        x = None
        for impl, res in zip(impls, results):
            t0 = time.perf_counter()
            if impl.range_check is not None:
                mism, first = impl.range_check(start, start + n)
                res.differ += int(mism)
                if first is not None and res.first is None:
                    res.first = int(first)
                res.inputs += n
                res.seconds += time.perf_counter() - t0
                continue
            s = stats[:(n + SUB - 1) // SUB]
            s[:] = 0
            if impl.fused == 0:
                libm_block(np.int64(start), c, 0, s)
            elif impl.fused is not None:
                fused_block(np.int64(start), c, impl.fused, s)
            else:
                if x is None:
                    x = np.arange(start, start + n, dtype=np.uint64).astype(np.uint32).view(np.float32)
                with np.errstate(all="ignore"):
                    y = np.ascontiguousarray(impl.array(x), dtype=np.float32)
                compare_block(np.int64(start), c, y.view(np.uint32), s)
            res.inputs += n
            res.differ += int(s[:, 0].sum())
            res.differ_bf16 += int(s[:, 1].sum())
            res.differ_softmax += int(s[:, 2].sum())
            res.softmax_inputs += int(s[:, 3].sum())
            res.max_ulps = max(res.max_ulps, int(s[:, 4].max()))
            firsts = s[:, 5][s[:, 5] >= 0]
            if firsts.size and res.first is None:
                res.first = int(firsts.min())
            res.seconds += time.perf_counter() - t0
        if progress is not None:
            progress(n)
    return results


def warm_up() -> None:
    """Compile the kernels (cached on disk after the first time)."""
    census_expf(0, 1 << 15, impls=implementations("numba"))


# -- CLI -----------------------------------------------------------------------------------------------

def f32_text(bits: int) -> str:
    """The float32 with these bits, as its shortest decimal (1.0000001, -inf, nan): a plain number."""
    return str(np.uint32(bits).view(np.float32))


def _parse_bits(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise ValueError(f"--range: {text!r} is not an integer (use e.g. 0x3f800000)") from None


def cmd_census(args, console) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .fit import fit_tables
    from .term import err as err_console
    from .term import wide
    if args.function != "expf":
        raise ValueError(f"census: unknown function {args.function!r} (expf)")
    lo, hi = 0, 1 << 32
    if args.range:
        a, sep, b = args.range.partition(":")
        if not sep:
            raise ValueError("--range LO:HI (bit patterns, e.g. 0xbf800000:0xbf900000)")
        lo, hi = _parse_bits(a), _parse_bits(b)
    only = [s for s in args.only.split(",") if s] if args.only else None
    impls = implementations(args.engine, only)
    t_compile = time.perf_counter()
    warm_up()
    t_compile = time.perf_counter() - t_compile
    t0 = time.perf_counter()
    err = err_console()
    with Progress(TextColumn("census expf"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                  TextColumn("{task.completed:,}/{task.total:,} inputs"), TimeElapsedColumn(), TimeRemainingColumn(),
                  console=err, disable=args.json or not err.is_terminal) as bar:
        task = bar.add_task("census", total=hi - lo)
        results = census_expf(lo, hi, impls=impls, progress=lambda n: bar.advance(task, n))
    wall = time.perf_counter() - t0
    import numba
    ours = {"numba": "oracle", "cpu": "cpu", "cuda": "cuda"}[args.engine]
    bad = [r for r in results if (r.name == ours or r.name.endswith("-vs-libm")) and r.differ]
    doc = {"function": "expf", "engine": args.engine, "range": [f"0x{lo:08x}", f"0x{hi:08x}"], "inputs": hi - lo,
           "seconds": round(wall, 2), "compile_seconds": round(t_compile, 2), "threads": numba.get_num_threads(),
           "results": [r.to_json() for r in results]}
    if args.json:
        print(json.dumps(doc))
        return 1 if bad else 0
    cols = [(c, "left" if c in ("implementation", "first differing input") else "right")
            for c in ("implementation", "differ", "%", "differ after bf16", "% (bf16)", "differ, x \u2264 0",
                      "% of x \u2264 0", "max ULP", "first differing input", "seconds")]
    rows = []
    for r in results:
        pct = lambda k, n: f"{100 * k / n:.4g}" if n else "-"                   # noqa: E731
        first = "-" if r.first is None else f"0x{r.first:08x} ({f32_text(r.first)})"
        if r.against != "oracle.numerics.expf":
            rows.append([r.name + " (vs libm)", f"{r.differ:,}", pct(r.differ, r.inputs), "-", "-", "-", "-", "-",
                         first, f"{r.seconds:.1f}"])
        else:
            rows.append([r.name, f"{r.differ:,}", pct(r.differ, r.inputs), f"{r.differ_bf16:,}",
                         pct(r.differ_bf16, r.inputs), f"{r.differ_softmax:,}", pct(r.differ_softmax, r.softmax_inputs),
                         str(r.max_ulps), first, f"{r.seconds:.1f}"])
    console = wide(console)
    title = f"expf census: {hi - lo:,} inputs [0x{lo:08x}, 0x{hi:08x}) against the canonical expf"
    for part in fit_tables(console.width, title, cols, rows, key=1):
        console.print(part)
    for r in results:
        console.print(f"  {r.name}: {r.about}", highlight=False)
    console.print(f"wall time {wall:.1f} s on {numba.get_num_threads()} threads (+ {t_compile:.1f} s compile/warm-up); "
                  f"ULPs are f32 ULPs between non-NaN results")
    if bad:
        console.print(f"[red]the canonical implementation differs[/red]: {', '.join(r.name for r in bad)}")
    return 1 if bad else 0


def register(sub, console) -> None:
    c = sub.add_parser(
        "census", help="exhaustive comparison of an exp implementation with the canonical one",
        description="oracle census expf: all 2^32 float32 inputs (or --range) through libm's expf, NumPy's "
                    "np.exp, two fast approximations and ours, counted against oracle.numerics.expf: overall, "
                    "after BF16 rounding, and for softmax's inputs x <= 0. Exit 0 when ours agrees everywhere.")
    c.add_argument("function", choices=["expf"])
    c.add_argument("--engine", default="numba", choices=["numba", "cpu", "cuda"],
                   help="whose canonical expf to census besides the reference implementations (default numba)")
    c.add_argument("--range", metavar="LO:HI", help="only the input bit patterns [LO, HI), e.g. 0xbf800000:0xbf900000")
    c.add_argument("--only", metavar="NAMES", help="comma-separated implementations to run (default: all)")
    c.add_argument("--json", action="store_true", help="one JSON object on stdout")
    c.set_defaults(func=lambda args: cmd_census(args, console))
