"""``tribucket.DistributedDataParallel``: torch DDP's class shape over one tribucket reducer.

A second front door onto :func:`tribucket.fused_bucketing` for code and frameworks built
around DDP: ``model = tribucket.DistributedDataParallel(model)`` takes DDP's constructor,
answers to ``.module``, ``no_sync()``, ``join()``, ``register_comm_hook``,
``require_backward_grad_sync`` and gives ``state_dict`` keys with DDP's ``module.`` prefix.
It is an ``nn.Module`` that holds the model and one :class:`tribucket.Reducer` attached to
it; every gradient is averaged by that reducer, exactly as inside ``fused_bucketing``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.utils import _to_kwargs

from . import hooks as _hooks
from .comm import broadcast_coalesced
from .config import ReducerConfig, check_process_group
from .ddp import Reducer

__all__ = ["DistributedDataParallel"]

#: DDP's options that mean what tribucket's options of the same name mean
_SHARED = ("bucket_cap_mb", "bucket_cap_mb_list", "find_unused_parameters",
           "gradient_as_bucket_view", "static_graph", "skip_all_reduce_unused_params")
#: tribucket's own options (keyword only here); the DDP-named ones come from DDP's signature
_OWN = tuple(f.name for f in dataclasses.fields(ReducerConfig)
             if f.name not in _SHARED and f.name != "broadcast_buffers")


def _refuse(name: str, value: Any, why: str) -> None:
    raise ValueError(f"tribucket.DistributedDataParallel: {name}={value!r} is not supported: "
                     f"{why}")


#: live wrappers, to hand a module over when it is wrapped again
_LIVE: "weakref.WeakSet[DistributedDataParallel]" = weakref.WeakSet()


def _close_quietly(holder: list) -> None:
    """Finalizer of a dropped wrapper: detach its reducer (hooks off, claims released)."""
    reducer = holder[0]
    if reducer is not None:
        holder[0] = None
        reducer._close(raise_errors=False)


class DistributedDataParallel(nn.Module, Joinable):
    """Wrap ``module`` as ``torch.nn.parallel.DistributedDataParallel`` does, with gradients
    averaged by one tribucket reducer.

    Example::

        model = tribucket.DistributedDataParallel(model)          # was: DDP(model)
        for x, y in loader:
            loss_fn(model(x), y).backward()   # .grad holds the average over ranks
            opt.step(); opt.zero_grad()

    DDP's arguments keep their positions and meanings: ``device_ids`` / ``output_device``
    (``None`` or the module's one device), ``dim``, ``broadcast_buffers`` (``True``: rank 0's
    buffers before each forward that follows a training one, as DDP; tribucket's
    ``broadcast_buffers="ddp"``), ``init_sync``, ``process_group``, ``bucket_cap_mb``,
    ``find_unused_parameters``, ``check_reduction`` (ignored, deprecated in DDP),
    ``gradient_as_bucket_view``, ``static_graph``, ``device_mesh`` (1-D),
    ``bucket_cap_mb_list`` (one cap per bucket; ``bucket_cap_mb`` is then ignored, as DDP
    ignores it), ``skip_all_reduce_unused_params``, ``forward_sync_buffers`` and
    ``batched_grad_copy`` (no effect: buckets are packed in one call). DDP's
    ``mixed_precision`` and ``delay_all_reduce_named_params`` / ``param_to_hook_all_reduce``
    raise a ``ValueError`` naming the alternative. tribucket's own
    options (``first_bucket_cap_mb``, ``timeout``, ``shard_optimizer``, ``comm_chunk_mb``,
    ``ignore_parameters``, ``debug``, ...) are keyword arguments.

    ``close()`` detaches the reducer (the wrapped module is then a plain module again); a
    wrapper that is garbage-collected detaches it too.
    """

    def __init__(self, module: nn.Module, device_ids: list | None = None,
                 output_device: Any = None, dim: int = 0, broadcast_buffers: bool | None = None,
                 init_sync: bool = True, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, delay_all_reduce_named_params: Any = None,
                 param_to_hook_all_reduce: Any = None, mixed_precision: Any = None,
                 device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: Any = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None, **options: Any):
        super().__init__()
        self._holder: list = [None]  # the reducer, shared with the finalizer
        if not isinstance(module, nn.Module):
            raise TypeError("tribucket.DistributedDataParallel wraps a torch.nn.Module, got "
                            f"{type(module).__name__}")
        unknown = sorted(set(options) - set(_OWN))
        if unknown:
            raise TypeError(
                f"tribucket.DistributedDataParallel got unexpected keyword argument(s) "
                f"{unknown}; it takes DDP's arguments and tribucket's options {list(_OWN)}")
        if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
            _refuse("delay_all_reduce_named_params", delay_all_reduce_named_params,
                    "every averaged gradient goes through the reducer's buckets; leave the "
                    "parameters to delay out of averaging with ignore_parameters=[...] and "
                    "all-reduce them yourself")
        if mixed_precision is not None:
            _refuse("mixed_precision", mixed_precision,
                    "use torch.autocast for the compute and a compression hook "
                    "(register_comm_hook(None, tribucket.hooks.bf16_compress_hook)) for "
                    "the communication")
        if skip_all_reduce_unused_params:
            options["skip_all_reduce_unused_params"] = skip_all_reduce_unused_params
        if bucket_cap_mb_list:  # DDP: the list's caps, bucket_cap_mb ignored
            options["bucket_cap_mb_list"], bucket_cap_mb = bucket_cap_mb_list, None
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(f"device_ids can only be None or contain a single element, got "
                             f"{device_ids!r}: one process per device")
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}: "
                                   "pass the data-parallel dimension, mesh['dp']")
            process_group = device_mesh.get_group(mesh_dim=0)
        check_process_group(process_group)
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module "
                          "is deprecated (and ignored). Please avoid using it.", FutureWarning,
                          stacklevel=2)

        params = [p for n, p in module.named_parameters()
                  if n not in set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))]
        if not any(p.requires_grad for p in params):
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any "
                f"parameter that requires a gradient: {type(module).__name__} has "
                f"{len(params)} parameter(s) to average and none requires grad; set "
                "requires_grad=True on the parameters to train, or do not wrap the module")
        devices = {p.device for p in params}
        device = next(iter(devices))
        if device.type == "cpu" or len(devices) > 1 or not device_ids:
            if device_ids or output_device:
                raise ValueError(
                    "device_ids and output_device only work with a module on one GPU (or "
                    f"are left None for a CPU module): got device_ids {device_ids}, "
                    f"output_device {output_device}, module parameters on {sorted(map(str, devices))}")
            self.device_ids, self.output_device = None, None
        else:
            self.device_ids = [torch._utils._get_device_index(device_ids[0], True)]
            self.output_device = torch._utils._get_device_index(
                device_ids[0] if output_device is None else output_device, True)
            if self.device_ids[0] != device.index:
                raise ValueError(f"device_ids={device_ids!r} but the module's parameters are "
                                 f"on {device}: move the module to the device first")

        # buffers: DDP's True is tribucket's "ddp" (also before evaluation forwards that
        # follow a training one); forward_sync_buffers=False still broadcasts them once
        if forward_sync_buffers is not None:
            sync_buffers, init_buffers = forward_sync_buffers, True
        else:
            sync_buffers = True if broadcast_buffers is None else broadcast_buffers
            init_buffers = bool(sync_buffers)
        if sync_buffers is True:
            sync_buffers = "ddp"
        if not init_sync:
            init_buffers = False  # entering still verifies and broadcasts the parameters
        # DDP's names to leave alone (unknown names are ignored, as DDP does)
        known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
        ignored = tuple(n for n in getattr(module, "_ddp_params_and_buffers_to_ignore", ())
                        if n in known)
        if ignored:
            options["ignore_parameters"] = tuple(options.get("ignore_parameters", ())) + ignored

        self.module = module
        #: DDP's name for the size of the coalesced broadcasts of parameters and buffers
        self.broadcast_bucket_size = 250 * 2**20
        #: names of the parameters and buffers left alone (DDP's attribute)
        self.parameters_to_ignore = set(ignored)
        if device_mesh is not None:
            self.device_mesh = device_mesh
        self.dim = dim
        self.device = device
        self.device_type = device.type
        self._user_broadcast_buffers = bool(sync_buffers)
        self._comm_hook: tuple | None = None
        self._supersede(module)
        if init_buffers and not sync_buffers:  # DDP syncs the buffers at construction anyway
            self._broadcast_buffers_once(module, process_group, set(ignored))
        reducer = Reducer(module, process_group, bucket_cap_mb=bucket_cap_mb,
                          find_unused_parameters=find_unused_parameters,
                          gradient_as_bucket_view=gradient_as_bucket_view,
                          static_graph=static_graph, broadcast_buffers=sync_buffers, **options)
        self._own(reducer)
        self._finalizer = weakref.finalize(self, _close_quietly, self._holder)
        _LIVE.add(self)

    def _supersede(self, module: nn.Module) -> None:
        """Wrapping a module again (``ddp = DistributedDataParallel(model, ...)`` in a loop
        over options) closes the earlier wrappers of its parameters, which then refuse to
        run; one nested inside ``module`` (a wrapper of a wrapper) is left alone, and
        attaching raises, naming the parameter (one reducer per parameter)."""
        mine = {id(p) for p in module.parameters()}
        inside = {id(m) for m in module.modules()}
        for other in list(_LIVE):
            reducer = other._holder[0]
            if reducer is None or id(other) in inside:
                continue
            if mine & {id(p) for p in reducer.averaged_parameters}:
                other._superseded = True
                other.close()

    def __getstate__(self) -> dict:
        # as DDP's: the reducer and the process group stay behind; unpickling attaches a new
        # reducer with the same options on the default group (the model's own forward hooks
        # pickle as inert ones)
        state = self.__dict__.copy()
        state["_holder"] = [None]
        state["_pickled_config"] = self.reducer.config
        state["_comm_hook"] = None
        del state["_finalizer"]
        return state

    def __setstate__(self, state: dict) -> None:
        config = state.pop("_pickled_config")
        super().__setstate__(state)
        self._own(Reducer(self.module, None, config=config))
        self._finalizer = weakref.finalize(self, _close_quietly, self._holder)
        _LIVE.add(self)

    @staticmethod
    def _broadcast_buffers_once(module: nn.Module, group: Any, ignored: set) -> None:
        buffers = [b.detach() for n, b in module.named_buffers() if n not in ignored]
        if buffers and dist.get_world_size(group) > 1:
            broadcast_coalesced(buffers, src=0, group=group)

    # ------------------------------------------------------------------ the reducer
    @property
    def reducer(self) -> Reducer:
        """The :class:`tribucket.Reducer` averaging this module's gradients (``found_inf``,
        ``grad_norm()``, ``stats``, ``logging_data()``...)."""
        reducer = self._holder[0]
        if reducer is None:
            if getattr(self, "_superseded", False):
                raise RuntimeError("this tribucket.DistributedDataParallel was closed when its "
                                   "module was wrapped again (a parameter is averaged by one "
                                   "wrapper at a time): use the newer wrapper")
            raise RuntimeError("this tribucket.DistributedDataParallel was closed; wrap the "
                               "module again to average its gradients")
        return reducer

    def close(self) -> None:
        """Detach the reducer from the module (every hook removed, communication in flight
        finished); the wrapper then refuses to run. Also done on garbage collection."""
        reducer, self._holder[0] = self._holder[0], None
        self._finalizer.detach()
        if reducer is not None:
            reducer.close()

    # ------------------------------------------------------------------ forward
    def _own(self, reducer: Reducer) -> Reducer:
        """Hold ``reducer`` as this wrapper's: DDP's buffer rule then applies to forwards
        through the wrapper, and ``self.module(x)`` is a plain module's forward."""
        reducer._forward.wrapped = True
        self._holder[0] = reducer
        return reducer

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.reducer  # a closed wrapper refuses to run: its gradients would not be averaged
        if self.device_ids:
            inputs, kwargs = _to_kwargs(inputs, kwargs, torch.device(self.device_type,
                                                                      self.device_ids[0]), False)
            inputs, kwargs = inputs[0], kwargs[0]
        reducer = self.reducer
        if self.module is not reducer.module:  # (ddp.module = another module)
            raise RuntimeError(
                f"tribucket.DistributedDataParallel: .module was replaced by a "
                f"{type(self.module).__name__} after the wrapper was built; its reducer "
                f"averages the parameters of the {type(reducer.module).__name__} it was built "
                "on, so the new module's would train on each rank's own gradient. Build a new "
                "DistributedDataParallel around the new module (and close this one)")
        fwd = reducer._forward
        fwd.via_wrapper = True
        try:
            return self.module(*inputs, **kwargs)
        finally:
            fwd.via_wrapper = False

    def train(self, mode: bool = True) -> "DistributedDataParallel":
        super().train(mode)
        return self

    # ------------------------------------------------------------------ DDP's methods
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward outside averages their sum.
        The forward must run inside the context, as with DDP."""
        with self.reducer.no_sync():
            yield

    @property
    def require_backward_grad_sync(self) -> bool:
        """``False``: the backward of the next forwards accumulates locally, as inside
        ``no_sync()`` (how nanoGPT accumulates); ``True`` (default): it averages. Read at
        the forward, as DDP's; the reducer's own attribute."""
        return self.reducer.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"require_backward_grad_sync must be a bool, got {value!r}")
        self.reducer.require_backward_grad_sync = value

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Register ``hook(state, bucket) -> Future[Tensor]``, torch's contract; see
        :meth:`tribucket.Reducer.register_comm_hook`."""
        self.reducer.register_comm_hook(state, hook)
        self._comm_hook = (state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """DDP's built-in ``ALLREDUCE`` / ``FP16_COMPRESS`` hooks, as tribucket's hooks."""
        builtin = {"ALLREDUCE": _hooks.allreduce_hook,
                   "FP16_COMPRESS": _hooks.fp16_compress_hook}
        name = getattr(comm_hook_type, "name", str(comm_hook_type).rsplit(".", 1)[-1])
        if name not in builtin:
            raise ValueError(f"unknown built-in comm hook {comm_hook_type!r}; expected "
                             f"{sorted(builtin)}")
        self.register_comm_hook(None, builtin[name])

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Train on uneven inputs, as ``DDP.join()``: ``with model.join(): ...``."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return self.reducer.join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return self.reducer.join_device

    @property
    def join_process_group(self) -> Any:
        return self.reducer.join_process_group

    @property
    def _join_config(self) -> Any:
        # Join sets it on each joinable; the reducer's forward hook is the one that reads it
        return self.reducer._join_config

    @_join_config.setter
    def _join_config(self, value: Any) -> None:
        self.reducer._join_config = value

    def _set_static_graph(self) -> None:
        """DDP's ``_set_static_graph()``: before the first backward, rebuild the reducer
        with ``static_graph=True`` (on every rank, as DDP's)."""
        old = self.reducer
        if old.config.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if old.stats.iterations > 0:
            raise RuntimeError("_set_static_graph() should be called before training loop "
                               "starts (before the first backward); pass static_graph=True "
                               "to the constructor instead")
        config = dataclasses.replace(old.config, static_graph=True)
        old.close()
        self._holder[0] = None
        new = self._own(Reducer(self.module, old.process_group, config=config))
        if self._comm_hook is not None:
            new.register_comm_hook(*self._comm_hook)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """DDP's logging dict: :meth:`tribucket.Reducer.logging_data`, with this wrapper's
        own ``broadcast_buffers`` (0/1, as DDP's; its reducer runs DDP's rule as ``"ddp"``)."""
        data = self.reducer.logging_data()
        data["broadcast_buffers"] = int(self._user_broadcast_buffers)
        return data

    def _remove_autograd_hooks(self) -> None:
        """DDP's: take the reducer's hooks off the module; here :meth:`close`."""
        self.close()

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """DDP's switch for cloning the outputs in its ``_DDPSink``; tribucket passes the
        outputs through untouched, so there is nothing to switch."""
        if not isinstance(val, bool):
            raise TypeError(f"_set_ddp_sink_clone takes a bool, got {val!r}")

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """DDP samples its runtime figures; tribucket's are current at every backward, so
        this only checks the value, as DDP does."""
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater "
                             f"than 1, got {sample_rate!r}")

    @staticmethod
    def _get_data_parallel_params(module: nn.Module, named_params: bool = False) -> Iterator:
        """DDP's: the module's parameters not marked to be ignored."""
        for param in module.named_parameters() if named_params else module.parameters():
            if not hasattr(param[1] if named_params else param, "_ddp_ignored"):
                yield param

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module,
                                                    params_and_buffers_to_ignore: Any) -> None:
        """DDP's way to leave parameters and buffers (by qualified name) alone: the
        wrapper passes them as ``ignore_parameters``."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        names = set(params_and_buffers_to_ignore)
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name in names:
                t._ddp_ignored = True

    # ------------------------------------------------------------------ DDP's attributes
    @property
    def process_group(self) -> Any:
        return self.reducer.process_group

    @property
    def find_unused_parameters(self) -> bool:
        return self.reducer.find_unused_parameters

    @property
    def static_graph(self) -> bool:
        return self.reducer.static_graph

    @property
    def gradient_as_bucket_view(self) -> bool:
        return self.reducer.gradient_as_bucket_view

    @property
    def bucket_bytes_cap(self) -> int:
        return self.reducer.bucket_bytes_cap

    @property
    def bucket_bytes_cap_list(self) -> list[int]:
        """``bucket_cap_mb_list`` in bytes, as DDP's attribute (``[]`` without one)."""
        return list(self.reducer.config.bucket_cap_bytes_list or [])

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast before forwards (read-only)."""
        return self._user_broadcast_buffers

    @property
    def forward_sync_buffers(self) -> bool:
        return self._user_broadcast_buffers

    @property
    def require_forward_param_sync(self) -> bool:
        """Whether the next forward broadcasts the buffers first (with ``broadcast_buffers``):
        as DDP's, True after a forward whose backward averages, False after one under
        ``no_sync()`` or ``torch.no_grad()``."""
        return self.reducer._forward.require_param_sync

    @require_forward_param_sync.setter
    def require_forward_param_sync(self, value: bool) -> None:
        self.reducer._forward.require_param_sync = bool(value)

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts rank 0's buffers (DDP's method)."""
        return (self.require_forward_param_sync and self.forward_sync_buffers
                and len(self.modules_buffers) > 0)

    @property
    def named_module_buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers that are not ignored, by name (DDP's attribute)."""
        return {n: b for n, b in self.module.named_buffers()
                if n not in self.parameters_to_ignore}

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        """The module's buffers that are not ignored (DDP's attribute)."""
        return list(self.named_module_buffers.values())

    @property
    def is_multi_device_module(self) -> bool:
        return len({p.device for p in self.module.parameters()}) > 1
