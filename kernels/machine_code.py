"""Compile every Triton kernel specialization for real GPU targets, without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs the whole
toolchain (TTIR -> TTGIR -> LLVM -> PTX -> ``ptxas`` -> cubin) on a CPU-only machine; the
triton wheel ships ``ptxas`` and ``cuobjdump``. This module

* lists the specializations the launchers can produce (``specializations()``): the pack /
  unpack variants come from the launchers' own dispatch (``_pack_variant``,
  ``_unpack_variant`` in ``kernels/pack_triton.py``), each in its scalar (``ALIGN=1``) and
  its 16-byte aligned form; the MoE kernels for every row dtype, K in ``MOE_KS``, with and
  without gate weights, scalar and aligned;
* compiles them for ``TARGETS`` and reads the machine code (``compile_all()``): registers,
  local memory (spills), shared memory, and the global loads/stores by width in the PTX and
  in the SASS (``cuobjdump -sass``).

``@triton.jit`` builds interpreter functions when ``TRITON_INTERPRET=1`` was set at import
(the test suite sets it on CPU machines). ``compile_all`` then compiles in a subprocess
without it; the results are cached on disk keyed by a hash of the kernel sources, this file,
the triton version and the targets, so an unchanged tree costs one file read.

Run ``python -m tribucket.kernels.machine_code [--out FILE]`` to compile everything here
(what ``compile_all`` does in its subprocess), ``--cache`` to fill the cache instead
(``compile_in_background``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from . import moe as _moe
from . import pack_triton as _pt

__all__ = ["TARGETS", "MOE_KS", "Spec", "specializations", "compile_all", "compile_in_background",
           "stop_background", "count_accesses"]

#: compute capabilities compiled for: A100 (sm_80) and H100 (sm_90)
TARGETS = (80, 90)
#: top-k values compiled for the MoE kernels (K is a constexpr: each K is its own kernel)
MOE_KS = (1, 2)
#: histogram widths compiled for the counts kernel (E_POW2 = next power of two >= experts)
MOE_E_POW2 = (8, 128)
_WARP = 32
_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.float64: "fp64", torch.int8: "i8", torch.int16: "i16",
                 torch.int32: "i32", torch.int64: "i64"}
#: every dtype a bucket or gradient can have (the enumeration's inputs)
_ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
               torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
               torch.complex64, torch.complex128)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One kernel specialization: what ``triton.compile`` needs, as plain data."""

    kernel: str                 #: attribute name of the ``@triton.jit`` function
    module: str                 #: "pack" (kernels/pack_triton.py) or "moe" (kernels/moe.py)
    signature: tuple            #: ((arg, triton type or "constexpr"), ...) in argument order
    constexprs: tuple           #: ((name, value), ...); dtypes as triton type names ("fp32")
    aligned: tuple              #: pointer/int args the launch sees as multiples of 16
    num_warps: int = 4
    fp_fusion: bool = True      #: enable_fp_fusion (the pack kernels launch with False)
    data: str = ""              #: the arg whose element type the label shows ("buffer", "x_ptr")

    @property
    def label(self) -> str:
        """E.g. ``_pack_kernel SRC=fp32 DST=fp16 COPY=0 CHECK=1 ALIGN=8``,
        ``_permute_kernel x_ptr=bf16 K=2 ALIGN=8``."""
        parts = [f"{self.data}={dict(self.signature)[self.data][1:]}"] if self.data else []
        parts += [f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.constexprs
                  if k not in ("BLOCK", "BLOCK_D")]
        return " ".join([self.kernel, *parts])

    @property
    def align(self) -> int:
        return dict(self.constexprs)["ALIGN"] if "ALIGN" in dict(self.constexprs) else 1


def _ptr(dtype: torch.dtype) -> str:
    return "*" + _TRITON_TYPES[dtype]


def _pack_specs() -> list[Spec]:
    seen, specs = set(), []
    for src in _ALL_DTYPES:
        for out in _ALL_DTYPES:
            for copy in ((True, False) if src == out else (False,)):
                for check in (False, True):
                    v = _pt._pack_variant(src, out, copy, check)
                    check = check and out.is_floating_point
                    if v is None or (v, check) in seen:
                        continue
                    seen.add((v, check))
                    _, s, d, is_copy = v
                    vec = _pt._VEC_BYTES // min(s.itemsize, d.itemsize)
                    for align in (1, vec):
                        sig = (("src_ptrs", "*i64"), ("sizes", "*i64"), ("offsets", "*i64"),
                               ("block_tensor", "*i32"), ("block_start", "*i64"),
                               ("out", _ptr(d)), ("found_inf", "*fp32" if check else "*i64"),
                               ("scale", "fp32"))
                        const = (("SRC", _TRITON_TYPES[s]), ("DST", _TRITON_TYPES[d]),
                                 ("COPY", is_copy), ("CHECK", check),
                                 ("BLOCK", _pt.BLOCK), ("ALIGN", align))
                        specs.append(_table_spec("_pack_kernel", sig, const, "out", align))
    return specs


def _unpack_specs() -> list[Spec]:
    seen, specs = set(), []
    for dst in _ALL_DTYPES:
        for buf in _ALL_DTYPES:
            for copy in ((True, False) if dst == buf else (False,)):
                for acc in ((False,) if copy else (False, True)):
                    if acc and not (dst.is_floating_point and buf.is_floating_point):
                        continue
                    for stats in (False, True):  # STATS: the reducer's epilogue
                        v = _pt._unpack_variant(dst, buf, copy, stats)
                        if v is None or (v, acc, stats) in seen:
                            continue
                        seen.add((v, acc, stats))
                        specs += _unpack_spec(v, acc, stats)
    return specs


def _unpack_spec(v, acc: bool, stats: bool) -> list[Spec]:
    view, d, is_copy = v
    vec = _pt._VEC_BYTES // min(view.itemsize, d.itemsize)
    out = []
    for align in (1, vec):
        sig = (("dst_ptrs", "*i64"), ("sizes", "*i64"), ("offsets", "*i64"),
               ("block_tensor", "*i32"), ("block_start", "*i64"),
               ("buffer", _ptr(view)), ("scale", "fp32"))
        const = (("DST", _TRITON_TYPES[d]), ("COPY", is_copy),
                 ("ACCUMULATE", acc), ("BLOCK", _pt.BLOCK), ("ALIGN", align))
        # the epilogue's scratch (allocated: aligned) and its flag (stats[1:]: 4-byte offset)
        tail = (("partials", "*fp32"), ("nonfinite", "*fp32"), ("STATS", True)) if stats else ()
        out.append(_table_spec("_unpack_kernel", sig, const, "buffer", align, tail,
                               unaligned=("nonfinite",)))
    return out


def _table_spec(kernel, sig, const, buffer_arg, align, tail=(), unaligned=()) -> Spec:
    """The pack/unpack kernels: our own tables are always 16-byte aligned; the bucket buffer
    is too in the aligned form, and is taken as unaligned (the worst case) in the scalar one.
    ``tail``: arguments after the constexprs, ``(name, pointer type)`` or ``(name, value)``
    for a constexpr; ``unaligned``: pointers never taken as 16-byte aligned."""
    ptrs = sig + tuple((n, t) for n, t in tail if isinstance(t, str))
    aligned = tuple(n for n, t in ptrs if t.startswith("*") and n not in unaligned
                    and (align > 1 or n != buffer_arg))
    const = const + tuple((n, v) for n, v in tail if not isinstance(v, str))
    sig = sig + tuple((k, "constexpr") for k, _ in const if k not in dict(tail)) + tuple(
        (n, t if isinstance(t, str) else "constexpr") for n, t in tail)
    return Spec(kernel, "pack", sig, const, aligned, _pt._NUM_WARPS, False,
                "buffer" if buffer_arg == "buffer" else "")


def _moe_specs() -> list[Spec]:
    specs = []
    for e_pow2 in MOE_E_POW2:
        specs.append(Spec("_counts_kernel", "moe",
                          (("ids_ptr", "*i64"), ("counts_ptr", "*i64"), ("S", "i32"),
                           ("E", "i32"), ("BLOCK", "constexpr"), ("E_POW2", "constexpr")),
                          (("BLOCK", _moe._COUNTS_BLOCK), ("E_POW2", e_pow2)),
                          ("ids_ptr", "counts_ptr")))
    for dtype in _moe._ROW_DTYPES:
        x, vec = _ptr(dtype), _pt._VEC_BYTES // dtype.itemsize
        for K in MOE_KS:
            for align in (1, vec):
                rows = align > 1  # the scalar form: row tensors taken as unaligned
                specs.append(_row_spec(dtype, "_permute_kernel", (
                    ("x_ptr", x, rows), ("dest_ptr", "*i64", True), ("out_ptr", x, rows)),
                    (("K", K),), align))
                for has_w in (False, True):
                    specs.append(_row_spec(dtype, "_unpermute_kernel", (
                        ("rows_ptr", x, rows), ("dest_ptr", "*i64", True),
                        ("w_ptr", "*fp32" if has_w else "*i64", True), ("y_ptr", x, rows)),
                        (("K", K), ("HAS_W", has_w)), align))
                specs.append(_row_spec(dtype, "_unpermute_bwd_kernel", (
                    ("grad_y_ptr", x, rows), ("rows_ptr", x, rows), ("dest_ptr", "*i64", True),
                    ("w_ptr", "*fp32", True), ("grad_rows_ptr", x, rows),
                    ("grad_w_ptr", "*fp32", True)), (("K", K),), align))
    return specs


def _row_spec(dtype, kernel, ptrs, const, align) -> Spec:
    """A row kernel: pointers, then D (an i32 not known to divide 16, e.g. 1000), then the
    constexprs K [, HAS_W], BLOCK_D, ALIGN."""
    const = const + (("BLOCK_D", _moe._block_d(dtype)), ("ALIGN", align))
    sig = tuple((n, t) for n, t, _ in ptrs) + (("D", "i32"),) + tuple(
        (k, "constexpr") for k, _ in const)
    return Spec(kernel, "moe", sig, const, tuple(n for n, _, a in ptrs if a), data=ptrs[0][0])


def specializations() -> list[Spec]:
    """Every kernel specialization the launchers can produce (MoE: for ``MOE_KS`` and
    ``MOE_E_POW2``), each once."""
    return _pack_specs() + _unpack_specs() + _moe_specs()


# ---------------------------------------------------------------------------------------
# reading the machine code
# ---------------------------------------------------------------------------------------
_PTX_ACCESS = re.compile(r"\b(ld|st|atom|red)\.global((?:\.\w+)*)")
_SASS_ACCESS = re.compile(r"\b(LDG|STG|ATOMG|REDG|RED|ATOM)((?:\.[A-Z0-9_]+)*)")
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def count_accesses(text: str, sass: bool = False) -> dict:
    """Global memory instructions by kind and width in bits: ``{"ld": {"128": 8, "64": 4},
    "st": {...}, "atomic": n}``.

    PTX: ``ld.global.v4.b32`` -> 128, ``ld.global.b16`` -> 16. SASS: ``LDG.E.128`` -> 128,
    ``LDG.E.64`` -> 64, ``LDG.E.U16`` -> 16, ``LDG.E`` -> 32.
    """
    out: dict = {"ld": Counter(), "st": Counter(), "atomic": 0}
    for op, mods in (_SASS_ACCESS if sass else _PTX_ACCESS).findall(text):
        if op.upper() in ("ATOM", "RED", "ATOMG", "REDG"):
            out["atomic"] += 1
            continue
        kind = "ld" if op.upper().startswith("LD") else "st"
        parts = mods.strip(".").split(".")
        if sass:
            width = 32
            for p in parts:
                if p in ("128", "64"):
                    width = int(p)
                elif p in ("U8", "S8", "U16", "S16"):
                    width = int(p[1:])
        else:
            vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
            bits = next((int(p[1:]) for p in parts if re.fullmatch(r"[bsuf]\d+", p)), 32)
            width = vec * bits
        out[kind][str(width)] += 1
    out["ld"], out["st"] = dict(sorted(out["ld"].items())), dict(sorted(out["st"].items()))
    return out


def _nvidia_tool(name: str) -> str:
    import triton.backends.nvidia as nv

    return os.path.join(os.path.dirname(nv.__file__), "bin", name)


def _compile_one(spec: Spec, cc: int, sass: bool = False) -> dict:
    """Compile ``spec`` for sm_``cc`` in this process (kernels must not be interpreted).

    ``sass``: also disassemble the cubin (``cuobjdump -sass``, ~0.4 s of CPU a kernel, more
    than the compile; the resource usage alone costs ~10 ms)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(_pt if spec.module == "pack" else _moe, spec.kernel)
    names = [n for n, _ in spec.signature]
    const = {k: (getattr(tl, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
                              "fp64": "float64", "i8": "int8", "i16": "int16", "i32": "int32",
                              "i64": "int64"}[v]) if isinstance(v, str) else v)
             for k, v in spec.constexprs}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.aligned}
    sig = dict(spec.signature)
    # trailing parameters a launch leaves at their defaults (the unpack epilogue's, when off)
    for name, prm in inspect.signature(fn.fn).parameters.items():
        if name not in sig and prm.default is not inspect.Parameter.empty:
            sig[name], const[name] = "constexpr", prm.default
    t0 = time.perf_counter()
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                            target=GPUTarget("cuda", cc, _WARP),
                            options={"num_warps": spec.num_warps,
                                     "enable_fp_fusion": spec.fp_fusion})
    seconds = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        dump = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", *(["-sass"] * sass),
                               f.name], check=True, capture_output=True, text=True).stdout
    reg, stack, shared, local = map(int, _RESOURCES.search(dump).groups())
    sass_lines = [ln for ln in dump.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", ln)]
    record = {
        "kernel": spec.kernel, "label": spec.label, "target": f"sm_{cc}",
        "constexprs": dict(spec.constexprs), "signature": dict(spec.signature),
        "align": spec.align,
        "num_warps": spec.num_warps, "registers": reg, "stack_bytes": stack,
        "local_bytes": local, "spilled": stack > 0 or local > 0,
        "shared_bytes": max(shared, kernel.metadata.shared),
        "ptx": count_accesses(kernel.asm["ptx"]),
        "ptx_instructions": sum(1 for ln in map(str.strip, kernel.asm["ptx"].splitlines())
                                if ln.endswith(";") and not ln.startswith((".", "//"))),
        "compile_s": round(seconds, 3),
    }
    if sass:
        record["sass"] = count_accesses("\n".join(sass_lines), sass=True)
        record["sass_instructions"] = len(sass_lines)
    return record


def _compile_share(args) -> list[dict]:
    specs, targets, sass, share, jobs = args
    jobs_list = [(s, cc) for cc in targets for s in specs]
    return [_compile_one(s, cc, sass) for s, cc in jobs_list[share::jobs]]


def _compile_here(specs, targets, jobs: int = 1, sass: bool = False) -> list[dict]:
    """Compile in this process, or in ``jobs`` worker processes (each takes every
    ``jobs``-th compile); records in (target, spec) order either way."""
    if _pt._interpreting_kernels():
        raise RuntimeError("the kernels were defined under TRITON_INTERPRET=1: compile in a "
                           "process without it (compile_all does this for you)")
    if jobs <= 1:
        return _compile_share((specs, targets, sass, 0, 1))
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(jobs) as pool:
        shares = pool.map(_compile_share, [(specs, targets, sass, i, jobs) for i in range(jobs)])
    n = len(specs) * len(targets)
    return [shares[i % jobs][i // jobs] for i in range(n)]


def _cache_key(targets, sass) -> str:
    import triton

    h = hashlib.sha256()
    for mod in (_pt, _moe, sys.modules[__name__]):
        h.update(Path(mod.__file__).read_bytes())
    h.update(f"{triton.__version__} {tuple(targets)} {sass}".encode())
    return h.hexdigest()[:24]


def _cache_dir() -> Path:
    base = os.environ.get("TRIBUCKET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tribucket")
    return Path(base) / "machine_code"


def _cache_path(targets, sass) -> Path:
    return _cache_dir() / f"{_cache_key(targets, sass)}.json"


def _compile_command(targets, sass, jobs: int, *mode: str) -> tuple[list[str], dict]:
    """This module run as a script in a process without ``TRITON_INTERPRET`` (argv, env)."""
    argv = [sys.executable, "-m", __name__, *mode, "--jobs", str(jobs), *(["--sass"] * sass),
            "--targets", *map(str, targets)]
    return argv, dict(os.environ, TRITON_INTERPRET="0")


#: compiles filling the disk cache in the background (:func:`compile_in_background`), by
#: cache file
_BACKGROUND: dict[Path, subprocess.Popen] = {}


def compile_in_background(targets=TARGETS, *, sass: bool = False,
                          jobs: int | None = None) -> subprocess.Popen | None:
    """Start filling the disk cache of :func:`compile_all` in a subprocess at the lowest CPU
    priority (``nice 19``: it takes the cores other work leaves idle) and return at once;
    ``None`` when the cache already holds these records. A later :func:`compile_all` of the
    same targets waits for it and reads the cache (and compiles in the foreground, with the
    error shown, if the background compile failed). The test suite starts it at collection,
    so the kernels compile while the distributed tests wait on their peers."""
    targets = tuple(targets)
    path = _cache_path(targets, sass)
    if path.exists() or path in _BACKGROUND:
        return _BACKGROUND.get(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    argv, env = _compile_command(targets, sass, jobs or os.cpu_count() or 1, "--cache")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=_lowest_priority)
    _BACKGROUND[path] = proc
    return proc


def _lowest_priority() -> None:
    """In the child before it runs: nice 19, in a session of its own whose autogroup is nice
    19 as well. (With autogroups, Linux's default, the scheduler first shares the CPUs out
    between sessions, nice or not: a process niced in the parent's session would still take
    half the CPUs from a job started in a new session, as torchrun jobs in the tests are.)"""
    os.setsid()
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:  # no autogroups (or not Linux): the process's own nice is what counts
        pass
    os.nice(19)


def stop_background() -> None:
    """Stop background compiles still running, with their worker processes (each leads a
    session of its own); their cache file is never half written."""
    import signal

    while _BACKGROUND:
        _, proc = _BACKGROUND.popitem()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
        proc.wait()


def compile_all(targets=TARGETS, *, sass: bool = False, use_cache: bool = True,
                jobs: int | None = None) -> list[dict]:
    """One record per (specialization, target), from the disk cache when the kernel sources
    are unchanged. Compiles in a subprocess without ``TRITON_INTERPRET`` when this process
    defined the kernels under the interpreter, with ``jobs`` worker processes (default: the
    CPU count). ``sass`` adds the SASS access counts (several times the compile's cost)."""
    jobs = jobs or os.cpu_count() or 1
    targets = tuple(targets)
    path = _cache_path(targets, sass)
    background = _BACKGROUND.pop(path, None)
    if background is not None:
        background.wait()  # it writes the cache, or fails and we compile below
    if use_cache and path.exists():
        return json.loads(path.read_text())
    if _pt._interpreting_kernels():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(suffix=".json", dir=path.parent, delete=False) as f:
            tmp = f.name
        try:
            argv, env = _compile_command(targets, sass, jobs, "--out", tmp)
            proc = subprocess.run(argv, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling the kernels failed (exit {proc.returncode}):\n"
                                   f"{proc.stderr[-4000:]}")
            records = json.loads(Path(tmp).read_text())
        finally:
            Path(tmp).unlink(missing_ok=True)
    else:
        records = _compile_here(specializations(), targets, jobs, sass)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(records))
        os.replace(tmp, path)  # atomic: a concurrent reader sees all or nothing
    return records


def _main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the records as JSON here (default: stdout)")
    ap.add_argument("--targets", nargs="+", type=int, default=list(TARGETS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="worker processes (default: the CPU count)")
    ap.add_argument("--sass", action="store_true", help="also count the SASS accesses")
    ap.add_argument("--cache", action="store_true",
                    help="fill compile_all's disk cache instead of writing the records")
    args = ap.parse_args(argv)
    if args.cache:
        compile_all(args.targets, sass=args.sass, jobs=args.jobs)
        return
    records = _compile_here(specializations(), args.targets, args.jobs, args.sass)
    text = json.dumps(records)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    _main()
