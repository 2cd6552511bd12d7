"""Build tribucket's native gradient hooks ahead of time, and report on them.

``python -m tribucket.build`` compiles the extension into the shared cache (see
``tribucket.ddp.native.build_dir``) if it is not there yet, then prints what is built and
where; run it in a Dockerfile or a CI image after ``pip install`` so that no job compiles at
its first step. ``python -m tribucket.build --report`` prints the same without building.
Without the binary, a reducer trains on the Python hooks (the same results) while the
extension compiles in the background, and switches when it is ready.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch

from .ddp import native

__all__ = ["main", "report"]


def report() -> list[tuple[str, str]]:
    """(what, value) rows: the torch build, the compiler, the cache folder, the status."""
    where = native.build_dir()
    binary = where / f"{native._NAME}.so"
    # (torch's extension builder compiles with $CXX when it is set, else c++)
    compiler = (os.environ.get("CXX") and f"{os.environ['CXX']} ($CXX)") or \
        shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    status = ("built" if binary.exists() else
              f"not built: {native.unavailable_reason()}" if native.unavailable_reason()
              else "not built yet")
    return [("torch", f"{torch.__version__} (C++11 ABI: {torch._C._GLIBCXX_USE_CXX11_ABI})"),
            ("python", sys.version.split()[0]),
            ("C++ compiler", compiler or "none found (the Python hooks are used)"),
            ("ninja", native._ninja_dir() or shutil.which("ninja") or "not installed"),
            ("cache", str(where)),
            ("native gradient hooks", status)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tribucket.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--report", action="store_true", help="report only, build nothing")
    what.add_argument("--quiet", action="store_true",
                      help="build and print nothing but, on failure, the reason (last line)")
    args = parser.parse_args(argv)
    if args.quiet:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ok = native.load() is not None
        if not ok:
            print(native.unavailable_reason(), flush=True)
        return 0 if ok else 1
    took = None
    if not args.report:
        t0 = time.perf_counter()
        native.load()
        took = time.perf_counter() - t0
    width = max(len(k) for k, _ in report())
    for k, v in report():
        print(f"{k:<{width}}  {v}")
    if took is not None:
        print(f"{'took':<{width}}  {took:.1f} s")
    return 0 if args.report or native.load() is not None else 1


if __name__ == "__main__":
    sys.exit(main())
