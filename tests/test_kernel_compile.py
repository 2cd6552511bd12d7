"""Every Triton kernel specialization compiled for sm_80 and sm_90 (no GPU needed), and the
properties of its machine code the project relies on: no spills, and in the aligned pack /
unpack kernels only 128-bit global accesses for the data.

The compiles run once per change of the kernel sources (``kernels/machine_code.py`` caches
them on disk); the interpreter tests at the end check that the specializations compiled are
the ones the launchers actually launch.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tribucket import kernels
from tribucket.kernels import machine_code as mc
from tribucket.kernels import moe as kmoe

P = importlib.import_module("tribucket.kernels.pack_triton")

pytestmark = [pytest.mark.compile,
              pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")]

_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp64": 8, "i8": 1, "i16": 2, "i32": 4, "i64": 8}
_TABLE_LOADS = {"64": 4, "32": 1}  # pointer, size, offset, block start (int64); block tensor


@pytest.fixture(scope="module")
def records():
    return mc.compile_all()


def _threads(r):
    return 32 * r["num_warps"]


def _vectors(r, elem: str, block: int) -> int:
    """128-bit accesses per thread to move one block of ``elem`` elements."""
    return block * _BYTES[elem] // 16 // _threads(r)


def test_every_specialization_compiles_for_every_target(records):
    specs = mc.specializations()
    assert len({s.label for s in specs}) == len(specs), "two specializations share a label"
    want = {(s.label, f"sm_{cc}") for s in specs for cc in mc.TARGETS}
    got = [(r["label"], r["target"]) for r in records]
    assert len(got) == len(set(got)), "a specialization was compiled twice"
    assert set(got) == want, f"missing {sorted(want - set(got))[:5]}, extra {sorted(set(got) - want)[:5]}"


def test_no_kernel_spills(records):
    spilled = [(r["label"], r["target"], r["local_bytes"], r["stack_bytes"])
               for r in records if r["spilled"]]
    assert not spilled, f"local memory (spills) in {spilled}"
    assert max(r["registers"] for r in records) <= 255


def test_aligned_pack_and_unpack_move_data_only_in_128_bit_accesses(records):
    """The aligned kernels: every data load and store is 128-bit (per thread, a block's
    bytes / 16); the only narrower accesses are the five table loads and found_inf. (The
    PTX; ``perf/kernel_report.py`` shows the SASS has the same counts.)"""
    asm = "ptx"
    checked = 0
    for r in records:
        if r["kernel"] not in ("_pack_kernel", "_unpack_kernel") or r["align"] == 1:
            continue
        c, sig = r["constexprs"], r["signature"]
        if r["kernel"] == "_pack_kernel":
            loads = _vectors(r, c["SRC"], c["BLOCK"])
            stores = {"128": _vectors(r, c["DST"], c["BLOCK"])}
            if c["CHECK"]:
                stores["32"] = 1  # found_inf
        else:
            loads = _vectors(r, sig["buffer"][1:], c["BLOCK"])
            if c["ACCUMULATE"]:
                loads += _vectors(r, c["DST"], c["BLOCK"])
            stores = {"128": _vectors(r, c["DST"], c["BLOCK"])}
            if c.get("STATS"):
                stores["32"] = 2  # the epilogue: the program's sum of squares, the flag
        what = f"{r['label']} on {r['target']} ({asm})"
        assert r[asm]["ld"] == {"128": loads, **_TABLE_LOADS}, f"{what}: loads {r[asm]['ld']}"
        assert r[asm]["st"] == stores, f"{what}: stores {r[asm]['st']}"
        checked += 1
    # 48 aligned pack/unpack specializations and 21 unpacks with the epilogue, two targets
    assert checked == 2 * (48 + 21), checked


def test_scalar_pack_and_unpack_have_no_128_bit_accesses(records):
    """The unaligned fallback really is the scalar kernel (the 'before' of the report)."""
    for r in records:
        if r["kernel"] in ("_pack_kernel", "_unpack_kernel") and r["align"] == 1:
            assert "128" not in r["ptx"]["ld"] and "128" not in r["ptx"]["st"], r["label"]


def test_aligned_moe_rows_move_in_the_widest_access_the_block_allows(records):
    """Row kernels: BLOCK_D / threads contiguous elements per thread (up to 16 bytes) move as
    one access; narrower accesses are only the routing table (int64), the gate weights and
    their gradients (fp32)."""
    checked = 0
    for r in records:
        c = r["constexprs"]
        if "BLOCK_D" not in c or r["align"] == 1:
            continue
        elem = next(t for n, t in r["signature"].items() if n.endswith("ptr"))[1:]
        width = min(16, c["BLOCK_D"] // _threads(r) * _BYTES[elem]) * 8
        K = c["K"]
        weights = r["kernel"] == "_unpermute_bwd_kernel" or c.get("HAS_W", False)
        narrow_ld = {}
        if width > 64:
            narrow_ld["64"] = K  # dest
        if weights:
            narrow_ld["32"] = K
        narrow_st = {"32": K} if r["kernel"] == "_unpermute_bwd_kernel" else {}
        for asm in ("ptx",):
            ld = {w: n for w, n in r[asm]["ld"].items() if int(w) < width}
            st = {w: n for w, n in r[asm]["st"].items() if int(w) < width}
            assert ld == narrow_ld and st == narrow_st, \
                f"{r['label']} {r['target']} {asm}: {r[asm]} (row accesses should be {width}-bit)"
            assert str(width) in r[asm]["ld"] and str(width) in r[asm]["st"], r["label"]
        checked += 1
    assert checked == 2 * 3 * len(mc.MOE_KS) * 4, checked


def test_compile_all_waits_for_the_background_compile_and_reads_its_cache(tmp_path, monkeypatch):
    """The suite starts the compile at collection (conftest); compile_all must take that
    compile's records, not start a second one, and must wait for it rather than find no
    cache and compile in the foreground. A stand-in process writes the cache late."""
    import subprocess
    import sys

    monkeypatch.setenv("TRIBUCKET_CACHE_DIR", str(tmp_path))
    path = mc._cache_path((80,), False)
    path.parent.mkdir(parents=True)
    stand_in = [{"label": "written by the background process"}]
    proc = subprocess.Popen([sys.executable, "-c",
                             f"import json, time; time.sleep(1.5); "
                             f"open({str(path)!r}, 'w').write(json.dumps({stand_in!r}))"])
    monkeypatch.setitem(mc._BACKGROUND, path, proc)
    monkeypatch.setattr(mc, "_compile_here", lambda *a, **k: pytest.fail("compiled again"))
    monkeypatch.setattr(mc.subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    assert mc.compile_all((80,)) == stand_in
    assert proc.poll() == 0 and path not in mc._BACKGROUND
    # with the cache filled, no background compile is started
    assert mc.compile_in_background((80,)) is None


# -- the specializations compiled are the ones the launchers launch -----------------------
class _LaunchSpy:
    """Records the constexprs (and the data pointer's dtype) of every launch, then runs it."""

    def __init__(self, kernel, name, data_arg, seen):
        self.kernel, self.name, self.data_arg, self.seen = kernel, name, data_arg, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            const = tuple(sorted((k, str(v) if not isinstance(v, (bool, int)) else v)
                                 for k, v in kwargs.items()
                                 if k not in ("num_warps", "enable_fp_fusion")
                                 and not isinstance(v, torch.Tensor)))  # (epilogue pointers)
            data = str(args[self.data_arg].dtype) if self.data_arg is not None else None
            self.seen.add((self.name, const, data))
            return self.kernel[grid](*args, **kwargs)
        return launch


def _spec_keys():
    keys = set()
    for s in mc.specializations():
        const = tuple(sorted((k, v) for k, v in s.constexprs))
        data = dict(s.signature)[s.data][1:] if s.data else None
        keys.add((s.kernel, const, data))
    return keys


#: torch and triton dtype names -> the signature's type names
_NAMES = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16",
          "torch.int8": "i8", "torch.int16": "i16", "torch.int32": "i32",
          "torch.int64": "i64", "torch.float64": "fp64",
          "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64"}


def _normalise(seen):
    return {(k, tuple((n, _NAMES.get(v, v) if isinstance(v, str) else v) for n, v in c),
             _NAMES.get(d, d)) for k, c, d in seen}


@pytest.mark.interpreter
@pytest.mark.skipif(not P._interpreting_kernels(), reason="needs TRITON_INTERPRET=1 (conftest)")
def test_pack_and_unpack_launch_only_compiled_specializations(monkeypatch):
    seen: set = set()
    cases = []
    for src in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                torch.int8, torch.bool):
        for out in ((src,) if not src.is_floating_point or src == torch.float64
                    else (torch.float32, torch.float16, torch.bfloat16)):
            for sizes in ([16, 32], [16, 3]):  # aligned, and an odd size
                cases.append((src, out, sizes))
    plans = {}
    for src, out, sizes in cases:
        if (tuple(sizes),) not in plans:
            plans[(tuple(sizes),)] = kernels.BucketPlan(sizes, [0, 16], 48, "cpu", backend="triton")
    monkeypatch.setattr(P, "_pack_kernel", _LaunchSpy(P._pack_kernel, "_pack_kernel", None, seen))
    monkeypatch.setattr(P, "_unpack_kernel",
                        _LaunchSpy(P._unpack_kernel, "_unpack_kernel", 5, seen))
    for src, out, sizes in cases:
        plan = plans[(tuple(sizes),)]
        ts = [torch.ones(n, dtype=src) for n in sizes]
        buf = torch.zeros(48, dtype=out)
        floating = src.is_floating_point and out.is_floating_point
        for scale in ((1.0, 0.5) if floating and src != torch.float64 else (1.0,)):
            for flag in ((None, torch.zeros(1)) if out.is_floating_point else (None,)):
                plan.pack(ts, buf, scale=scale, found_inf=flag)
            for acc in ((False, True) if floating and src != torch.float64 else (False,)):
                plan.unpack(buf, ts, scale=scale, accumulate=acc)
                if floating:  # the epilogue (the reducer's norm and flag)
                    plan.unpack(buf, ts, scale=scale, accumulate=acc, stats=torch.zeros(2))
    launched = _normalise(seen)
    assert len(launched) > 30, len(launched)
    missing = launched - _spec_keys()
    assert not missing, f"launched but never compiled: {sorted(missing)[:5]}"


@pytest.mark.interpreter
@pytest.mark.skipif(not kmoe._INTERPRET, reason="needs TRITON_INTERPRET=1 (conftest)")
def test_moe_kernels_launch_only_compiled_specializations(monkeypatch):
    seen: set = set()
    for name, data_arg in (("_permute_kernel", 0), ("_unpermute_kernel", 0),
                           ("_unpermute_bwd_kernel", 0), ("_counts_kernel", None)):
        monkeypatch.setattr(kmoe, name, _LaunchSpy(getattr(kmoe, name), name, data_arg, seen))
    kmoe.moe_counts(torch.tensor([0, 3, 2]), 5, backend="triton")
    for dtype in kmoe._ROW_DTYPES:
        for D in (16, 5):  # aligned, and an odd row length
            for K in mc.MOE_KS:
                dest = torch.arange(3 * K).view(3, K)
                x = torch.ones(3, D, dtype=dtype)
                rows = kmoe.moe_permute(x, dest, 3 * K, backend="triton")
                kmoe.moe_unpermute(rows, dest, None, backend="triton")
                w = torch.rand(3, K)
                kmoe.moe_unpermute(rows, dest, w, backend="triton")
                kmoe.moe_unpermute_backward(x, rows, dest, w, backend="triton")
    launched = {(k, c, d if k != "_counts_kernel" else None) for k, c, d in _normalise(seen)}
    keys = {(k, c, d) for k, c, d in _spec_keys()}
    assert len(launched) == 2 * 3 * len(mc.MOE_KS) * 4 + 1, len(launched)
    missing = launched - keys
    assert not missing, f"launched but never compiled: {sorted(missing)[:5]}"
