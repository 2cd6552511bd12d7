"""Native gradient-ready hooks: the per-gradient common case in C++.

A Python post-accumulate-grad hook costs about a microsecond per gradient before it does
anything, and more on a loaded CPU; DDP's reducer does its per-gradient work in C++. These
hooks (``ready_hooks.cpp``, a post hook on each parameter's gradient accumulator, as DDP's)
do the common case without entering Python: mark the gradient ready and count it down in
its bucket. Python runs once per completed bucket (``on_complete(bucket)``) and for every
gradient the native path does not handle (``fallback(parameter)``): the first of a pass,
``no_sync``, ``static_graph``/``find_unused_parameters`` bookkeeping, buckets packed as
gradients arrive, sparse buckets, misuse.

The extension is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler
and ``ninja``; about 20 s, cached under ``TORCH_EXTENSIONS_DIR``, see :func:`build_dir`). Where it cannot be built the
reducer uses its Python hooks, which behave the same; ``ReducerConfig.native_hooks=True``
makes that an error instead.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
import weakref

import torch

__all__ = ["NO_NATIVE", "NativeHooks", "load", "unavailable_reason"]

_SOURCE = pathlib.Path(__file__).with_name("ready_hooks.cpp")
_NAME = "tribucket_ready_hooks"
_lock = threading.Lock()
_start_lock = threading.Lock()
_module = None
_error: str | None = None
_building: subprocess.Popen | None = None  # the background build this process started
_build_log = None                          # its output (read if it fails)
#: the background build: a process of its own, in its own session, so that it outlives a
#: short script (a build in a thread would die with it, half done, at every exit)
BUILD_COMMAND = [sys.executable, "-m", "tribucket.build", "--quiet"]


def load(wait: bool = True, quiet: bool = False):
    """The compiled extension, or None when it cannot be built (see
    :func:`unavailable_reason`).

    ``wait=False``: the extension if it is built already (importing a cached binary takes
    milliseconds), else None at once, with the build started in a background process
    (``python -m tribucket.build``, once per process; :func:`ready` tells when it is over).
    Processes sharing a machine build it once between them (a file lock): the other builds
    wait for it and find the binary. ``quiet``: no warning when it cannot be built (the
    caller raises instead of falling back to the Python hooks)."""
    global _module, _error, _building, _build_log
    if _module is not None or _error is not None:
        return _module
    if not wait:
        try:
            cached = (build_dir() / f"{_NAME}.so").exists()
        except Exception:  # noqa: BLE001 - the blocking load reports it
            cached = True
        if cached:
            return load()
        with _start_lock:
            if _building is None:
                _build_log = tempfile.TemporaryFile()
                try:
                    _building = subprocess.Popen(BUILD_COMMAND, stdin=subprocess.DEVNULL,
                                                 stdout=_build_log, stderr=subprocess.STDOUT,
                                                 start_new_session=True)
                except OSError as e:
                    _fail(e)
        return None
    with _lock:
        if _module is None and _error is None:
            try:
                _module = _load_or_build(build_dir())
            except Exception as e:  # noqa: BLE001 - any build failure means "use Python"
                _fail(e, warn=not quiet)
    return _module


def ready() -> bool:
    """Whether :func:`load` has its answer (the extension, or why not) without waiting:
    loaded or failed already, or the binary is built, or the background build failed."""
    if _module is not None or _error is not None:
        return True
    try:
        if (build_dir() / f"{_NAME}.so").exists():
            return True
    except Exception:  # noqa: BLE001 - load() reports it
        return True
    child = _building
    if child is None or child.poll() is None:
        return False
    if child.returncode != 0 and _error is None:
        _build_log.seek(0)
        lines = _build_log.read().decode(errors="replace").strip().splitlines()
        _fail(RuntimeError(lines[-1] if lines else f"exit code {child.returncode}"))
    return True


def _fail(e: BaseException, warn: bool = True) -> None:
    global _error
    lines = str(e).strip().splitlines()
    _error = f"{type(e).__name__}: {lines[-1] if lines else ''}"
    if warn:
        warnings.warn("tribucket: the native gradient hooks could not be built "
                      f"({_error}); using the Python hooks (same results, more host "
            "time per gradient). Install a C++ compiler and `ninja`, or "
            "pass native_hooks=False to silence this.", RuntimeWarning, stacklevel=4)


def build_dir() -> pathlib.Path:
    """Where the extension is built and cached: under ``TORCH_EXTENSIONS_DIR`` (torch's
    default: ``~/.cache/torch_extensions``), in a folder named after what the binary depends
    on (the source, torch's version and ABI, Python's version), not after the checkout or
    the environment's path: every checkout and venv with the same torch shares one build."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    key = hashlib.sha256(_SOURCE.read_bytes())
    key.update(f"{torch.__version__}|{torch._C._GLIBCXX_USE_CXX11_ABI}|"
               f"{sys.version_info[:2]}|{sys.platform}".encode())
    return pathlib.Path(root) / f"{_NAME}-{key.hexdigest()[:16]}"


def _load_or_build(where: pathlib.Path):
    """Import the cached binary, or build it first. One build at a time per folder: an
    ``flock`` (the kernel releases it when its holder dies, so a build killed half-way never
    leaves the next one waiting on a stale lock file, as torch's own lock file does)."""
    binary = where / f"{_NAME}.so"
    if not binary.exists():
        where.mkdir(parents=True, exist_ok=True)
        with open(where.with_name(where.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not binary.exists():
                return _build(where)
    return _import(binary)


def _build(where: pathlib.Path):
    """Compile into ``where/build`` (from scratch: we hold the folder's flock, so anything
    there is left by a build that was killed), then move the binary into place in one
    rename: a binary at its final path is always whole."""
    from torch.utils.cpp_extension import load as build

    scratch = where / "build"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    path = os.environ.get("PATH", "")
    try:
        # the pip-installed ninja, even when its environment is not activated
        if _ninja_dir():
            os.environ["PATH"] = _ninja_dir() + os.pathsep + path
        module = build(_NAME, [str(_SOURCE)], extra_cflags=["-O2"],
                       build_directory=str(scratch), verbose=False)
    finally:
        os.environ["PATH"] = path
    os.replace(scratch / f"{_NAME}.so", where / f"{_NAME}.so")
    return module


def _import(binary: pathlib.Path):
    spec = importlib.util.spec_from_file_location(_NAME, binary)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_dir() -> str:
    try:
        import ninja

        return getattr(ninja, "BIN_DIR", "")
    except ImportError:
        return ""


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (after it did), else None."""
    return _error


class NativeHooks:
    """The reducer's side of the native hooks of one model.

    During a *plain* pass (see ``state.Pass.plain``) the buckets the native path handles
    (``native[b]``: dense, packed when complete, sent whole) keep their ready flags in the
    pass's ``ready`` bytearray (shared with C++) and their counts in C++; :meth:`end` copies
    the counts back to ``bucket.pending`` when the pass ends. Every other gradient goes to
    its :class:`~tribucket.ddp.bucket.GradHook` as the Python hooks would.
    """

    def __init__(self, module, params: list, bw):
        self.bw = bw
        self.on = False                        # a pass is counted natively now
        self.native: list[int] = []            # per bucket: 1 if counted natively
        # C++ holds the callbacks where the garbage collector cannot see them: they reach
        # this object through a weak reference, so a dropped model's reducer is collected
        ref = weakref.ref(self)
        self.hooks = module.Hooks(params, functools.partial(_complete, ref),
                                  functools.partial(_fallback, ref))
        if bw.allocated:
            self.layout(bw.buckets, bw.slot)

    def layout(self, buckets: list, slot: list) -> None:
        """The buckets of a new layout (no pass under way: C++ refuses one otherwise)."""
        self.native = [int(getattr(b, "native_ok", False)) for b in buckets]
        self.hooks.layout([bucket.index for bucket, _ in slot], len(buckets))

    def begin(self, p, buckets: list) -> None:
        """Pass ``p`` is plain from here on: count its native buckets in C++."""
        if any(self.native):
            self.hooks.begin(torch.frombuffer(p.ready, dtype=torch.uint8),
                             [b.pending for b in buckets], self.native,
                             self.bw.comm.tracer is not None)  # (stamp first gradients)
            self.on = True

    def mark(self, index: int) -> bool:
        """Count parameter ``index`` (of a native bucket) in from Python; whether its bucket
        is complete."""
        return self.hooks.mark(index)

    def first_ns(self, b: int) -> int:
        """When bucket ``b``'s first gradient was counted in C++ in this traced pass
        (``time.perf_counter_ns``; 0: not)."""
        return self.hooks.first_ns(b) if self.on and self.native[b] else 0

    def end(self, buckets: list) -> None:
        """The pass ends (or is abandoned): the native buckets' counts back to Python."""
        if self.on:
            self.on = False
            for bucket, native, left in zip(buckets, self.native, self.hooks.end()):
                if native:
                    bucket.pending = left

    def stale(self) -> list[int]:
        """The parameters whose gradient accumulator torch replaced since the hooks went on
        (``param.data`` set to another dtype or device): these hooks no longer fire."""
        return self.hooks.stale(self.bw.params)

    def remove(self) -> None:
        """Take the hooks off the parameters (``close()``)."""
        self.hooks.remove()


def _fallback(ref, index: int) -> None:
    self = ref()
    if self is not None:
        self.bw.grad_hooks[index](None)


def _complete(ref, b: int) -> None:
    self = ref()
    if self is not None:
        bw = self.bw
        bucket = bw.buckets[b]
        bucket.pending = 0
        bw.bucket_complete(bw.pass_, bucket)


class _NoNative:
    """The reducer's ``native`` when the Python hooks count gradients in: nothing to do."""

    on = False

    def begin(self, p, buckets: list) -> None:
        pass

    def end(self, buckets: list) -> None:
        pass

    def layout(self, buckets: list, slot: list) -> None:
        pass

    def first_ns(self, b: int) -> int:
        return 0

    def stale(self) -> list[int]:
        return []  # (the Python hooks are on the tensors: they outlive the accumulators)


NO_NATIVE = _NoNative()
