"""Calling communication hooks, checking what they return, and the reducer's own hooks."""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..grad_bucket import GradBucket
from ..hooks import _torch_single_collective_hooks
from ..layout import Bucket

__all__ = ["HookRef", "hook_name", "invoke", "invoke_after", "check_result",
           "check_signature", "lend_timed_group"]


def hook_name(hook: Callable | None) -> str:
    if hook is None:
        return "allreduce (default)"
    return getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or repr(hook)


_BUCKET_TYPES = (GradBucket, dist.GradBucket)
_BUCKET_NAMES = {"GradBucket", "dist.GradBucket", "torch.distributed.GradBucket",
                 "tribucket.GradBucket", "tribucket.grad_bucket.GradBucket"}


def check_signature(hook: Callable) -> None:
    """Refuse, at registration, a hook whose annotations say it is not ``hook(state, bucket)
    -> Future[Tensor]`` (torch DDP's check): the bucket parameter annotated as something
    other than a ``GradBucket``, or the return as something other than a ``Future``.
    Unannotated hooks pass; string annotations are read by name."""
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to read
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < 2 and not any(p.kind == p.VAR_POSITIONAL
                                   for p in sig.parameters.values()):
        raise TypeError(f"comm hook {hook_name(hook)} takes {len(params)} positional "
                        "argument(s); a hook is called as hook(state, bucket)")
    bucket = sig.parameters.get("bucket", params[1] if len(params) > 1 else None)
    ann = bucket.annotation if bucket is not None else inspect.Parameter.empty
    if ann is not inspect.Parameter.empty and not (
            ann in _BUCKET_TYPES or (isinstance(ann, str) and ann in _BUCKET_NAMES)):
        raise ValueError(f"comm hook {hook_name(hook)}: its bucket argument is annotated "
                         f"{ann!r}; it receives a torch.distributed.GradBucket (annotate it "
                         "so, or not at all)")
    ret = sig.return_annotation
    if ret is not inspect.Signature.empty and not _is_future(ret):
        raise ValueError(f"comm hook {hook_name(hook)}: its return is annotated {ret!r}; a "
                         "hook returns a torch.futures.Future[torch.Tensor] (annotate it so, "
                         "or not at all)")


def _is_future(ann: Any) -> bool:
    if isinstance(ann, str):
        return ann.split("[", 1)[0].split(".")[-1] == "Future"
    origin = getattr(ann, "__origin__", ann)
    return isinstance(origin, type) and issubclass(origin, torch._C.Future)


def invoke(hook: Callable, state: Any, b: int, gb: GradBucket) -> torch.futures.Future:
    """Call ``hook(state, bucket)`` now and check that it returned a Future."""
    try:
        fut = hook(state, gb)
    except Exception as e:
        raise RuntimeError(f"comm hook {hook_name(hook)} raised on bucket {b}: "
                           f"{type(e).__name__}: {e}") from e
    if not isinstance(fut, torch._C.Future):
        raise RuntimeError(f"comm hook {hook_name(hook)} returned {type(fut).__name__} for "
                           f"bucket {b}; a hook must return a torch.futures.Future whose value "
                           "is the bucket's new tensor")
    return fut


def invoke_after(prev: torch.futures.Future | None, hook: Callable, state: Any, b: int,
                 gb: GradBucket) -> torch.futures.Future:
    """Call the hook only once ``prev`` (the previous bucket's hook future) has completed.

    A hook whose callbacks launch collectives (PowerSGD) would otherwise interleave them with
    the next bucket's collectives in a different order on different ranks. The call happens
    on the thread that completes ``prev`` (the communication library's worker), so backward
    is not stalled. Returns a future completed with the hook future's value.
    """
    chain: torch.futures.Future = torch.futures.Future()
    name = hook_name(hook)

    def finish(fut: torch.futures.Future) -> None:
        try:
            chain.set_result(fut.value())
        except Exception as e:  # noqa: BLE001 - handed to the waiting main thread
            chain.set_exception(e)

    def call(prev_fut: Any = None) -> None:
        if prev_fut is not None:
            try:
                prev_fut.value()
            except Exception as e:  # noqa: BLE001 - no more collectives after a failure
                chain.set_exception(RuntimeError(f"comm hook {name} was not called on bucket "
                                                 f"{b}: the previous bucket failed: {e}"))
                return
        try:
            fut = hook(state, gb)
            if not isinstance(fut, torch._C.Future):
                raise TypeError(f"returned {type(fut).__name__}, not a torch.futures.Future")
            fut.add_done_callback(finish)
        except Exception as e:  # noqa: BLE001
            chain.set_exception(RuntimeError(f"comm hook {name} raised on bucket {b}: "
                                             f"{type(e).__name__}: {e}"))

    if prev is None:
        call()
    else:
        prev.add_done_callback(call)  # runs at once if prev is done
    return chain


def check_result(hook: Callable | None, b: int, bucket: Bucket, value: Any) -> torch.Tensor:
    """The tensor a hook's future completed with, or a clear error naming the bucket."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    name = hook_name(hook)
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"comm hook {name} completed bucket {b} with {type(value).__name__}; "
                           f"expected a tensor of {bucket.numel} elements")
    if bucket.sparse:
        return value
    if value.numel() != bucket.numel:
        raise RuntimeError(f"comm hook {name} completed bucket {b} with a tensor of "
                           f"{value.numel()} elements (shape {list(value.shape)}); the bucket "
                           f"holds {bucket.numel} elements of {bucket.dtype}")
    if not value.is_floating_point():
        raise RuntimeError(f"comm hook {name} completed bucket {b} with a {value.dtype} tensor; "
                           f"expected a floating-point tensor (the bucket is {bucket.dtype})")
    return value.reshape(-1)


class HookRef:
    """A hook the reducer installs on the model, its parameters or autograd nodes.

    It holds the reducer only while attached (``close()`` cuts it), and copying or
    pickling the model (``copy.deepcopy(model)`` for an EMA copy, ``torch.save(model)``)
    gives the copy an inert hook instead of a copy of the reducer.
    """

    __slots__ = ("fn", "method", "args")

    def __init__(self, reducer: Any, method: str, args: tuple = ()):
        self.method, self.args = method, args
        # the bound method, resolved once (a hook on every parameter is called per gradient)
        self.fn = getattr(reducer, method) if reducer is not None else None

    def detach(self) -> None:
        """Cut the link to the reducer: the hook does nothing from now on."""
        self.fn = None

    def __call__(self, *a: Any) -> Any:
        fn = self.fn
        if fn is None:
            return None
        return fn(*self.args, *a)

    def __deepcopy__(self, memo: dict) -> "HookRef":
        return type(self)(None, self.method)  # (an inert hook of the same kind)

    def __reduce__(self):
        return (type(self), (None, self.method))


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the caller (no import of dynamo before it ran)."""
    return "torch._dynamo" in sys.modules and torch.compiler.is_compiling()


class ForwardHookRef(HookRef):
    """A forward hook of the reducer that ``torch.compile`` runs eagerly instead of tracing
    it into the model's graph (a model compiled after entering): its broadcasts and
    bookkeeping would split the graph in pieces. Until ``torch.compile`` has imported
    ``torch._dynamo`` it is a plain :class:`HookRef` (one dict lookup more)."""

    __slots__ = ("outside",)

    def __init__(self, reducer: Any, method: str, args: tuple = ()):
        super().__init__(reducer, method, args)
        self.outside: Callable | None = None  # self._plain, marked for dynamo to skip

    def __call__(self, *a: Any) -> Any:
        if "torch._dynamo" in sys.modules:
            if self.outside is None:
                self.outside = sys.modules["torch._dynamo"].disable(self._plain)
            return self.outside(*a)
        fn = self.fn
        return None if fn is None else fn(*self.args, *a)

    def _plain(self, *a: Any) -> Any:
        fn = self.fn
        return None if fn is None else fn(*self.args, *a)


def lend_timed_group(group, hook: Callable, state: Any) -> tuple[Any, Any]:
    """With ``timeout=`` (``group``: the reducer's timed hook group, else None): the state a
    torch hook gets so its collectives go to a group with that timeout where it would use
    the default group (``state=None`` for the hooks whose state is the process group; a
    state whose ``process_group`` is None), and the state object lent the group (given back
    at close), if any."""
    if group is None:
        return state, None
    if state is None and hook in _torch_single_collective_hooks():
        return group, None  # their state *is* the process group; None: the default one
    if (state is not None and not isinstance(state, dist.ProcessGroup)
            and getattr(state, "process_group", False) is None
            and getattr(hook, "_tribucket_traits", None) is None):
        state.process_group = group  # e.g. PowerSGDState(process_group=None)
        return state, state
    return state, None
