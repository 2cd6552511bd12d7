"""tribucket under PyTorch Lightning and Lightning Fabric: ``strategy="tribucket"``.

Importing this module registers the name ``"tribucket"`` (and ``"tribucket_find_unused_parameters_true"``,
``"tribucket_spawn"``) with Lightning's and Fabric's strategy registries, so that::

    import tribucket.lightning                      # registers the strategies
    trainer = L.Trainer(strategy="tribucket", accelerator="cpu", devices=2)
    fabric = L.Fabric(strategy="tribucket", accelerator="cpu", devices=2)

train as ``strategy="ddp"`` does, with :func:`tribucket.fused_bucketing` averaging the
gradients. An instance takes its options: ``FusedBucketingStrategy(hook="fp16",
bucket_cap_mb=5, find_unused_parameters=True)`` (``FusedBucketingFabricStrategy`` for Fabric).

The strategies follow Lightning's ``DDPStrategy`` (same launchers, process group, samplers,
collectives); what changes is the wrapper. The reducer attaches to a thin module around the
LightningModule, as DDP's wrapper does, so Lightning's calls to ``training_step`` go through
it (the reducer's forward hooks see each training step) and the LightningModule's own
``self(x)`` calls do not. Lightning's DDP habits map onto the reducer:

* ``accumulate_grad_batches`` / ``fabric.no_backward_sync``: ``reducer.no_sync()``;
* ``gradient_clip_val`` (norm) / ``fabric.clip_gradients``: :func:`tribucket.clip_grad_norm_`;
* ``precision="16-mixed"``: :class:`tribucket.amp.GradScaler` (the reducer's ``found_inf``
  instead of the scaler's scan); ``"bf16-mixed"`` needs no scaler;
* checkpoints: the LightningModule's ``state_dict`` as with DDP (no prefix), plus the
  reducer's state under ``"tribucket"``, restored by ``ckpt_path=`` resumes.

Lightning is imported here only; ``import tribucket`` does not need it.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

try:
    import lightning.fabric as _lf
    import lightning.pytorch as _pl
except ImportError as e:  # pragma: no cover - exercised without lightning installed
    raise ImportError("tribucket.lightning needs Lightning: pip install 'lightning>=2.4' "
                      f"(or tribucket[integrations]); importing it failed: {e}") from e

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision.amp import MixedPrecision as _FabricMixed
from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.fabric.strategies import DDPStrategy as _FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.plugins.precision import MixedPrecision as _PLMixed
from lightning.pytorch.plugins.precision import Precision as _PLPrecision
from lightning.pytorch.strategies import DDPStrategy as _PLDDPStrategy
from lightning.pytorch.strategies import StrategyRegistry as _PL_REGISTRY
from lightning.pytorch.trainer.states import TrainerFn

from . import hooks as _hooks
from ._tags import is_expert_parallel
from .amp import GradScaler
from .clip import clip_grad_norm_
from .config import ReducerConfig
from .ddp import Reducer
from .ddp.resume import own_entries

_logger = logging.getLogger("tribucket")

__all__ = ["FusedBucketingStrategy", "FusedBucketingFabricStrategy", "CHECKPOINT_KEY"]

#: where the reducer's state goes in a Lightning checkpoint
CHECKPOINT_KEY = "tribucket"
#: a checkpoint entry saved per rank (an expert-parallel model's optimizer state)
PER_RANK_KEY = "tribucket_per_rank"

_HOOKS = {None: None, "allreduce": _hooks.allreduce_hook, "fp16": _hooks.fp16_compress_hook,
          "bf16": _hooks.bf16_compress_hook}


def _resolve_hook(hook: str | Callable | None) -> Callable | None:
    if hook is None or callable(hook):
        return hook
    if hook not in _HOOKS:
        raise ValueError(f"hook={hook!r} is not one of {sorted(k for k in _HOOKS if k)}; pass "
                         "one of those names, None (the default averaging) or a comm hook "
                         "callable hook(state, bucket) -> Future")
    return _HOOKS[hook]


def _options(hook, hook_state, options: dict) -> tuple[Callable | None, Any, dict]:
    """Validate the reducer options once, where the strategy is built (every rank)."""
    ReducerConfig(**options)  # raises ValueError/TypeError naming a bad option and its value
    if options.get("shard_optimizer"):
        raise ValueError("shard_optimizer=True is not supported by the Lightning strategies: "
                         "the sharded reducer's gradients are stepped by a "
                         "tribucket.ShardedOptimizer built over the reducer, and the optimizer "
                         "configure_optimizers returns (or fabric.setup is given) cannot be "
                         "one (a plain optimizer would see no gradient). Drop the option, or "
                         "write the loop with tribucket.fused_bucketing(model, "
                         "shard_optimizer=True)")
    return _resolve_hook(hook), hook_state, options


# -- checkpoints of expert-parallel models: Lightning writes rank 0's file only
def _has_experts(module: nn.Module) -> bool:
    return any(is_expert_parallel(p) for p in module.parameters())


def _every_ranks_experts(state: dict) -> dict:
    """On rank 0, the module state dict ``state`` with the entries rank 0 lacks from every
    other rank's (their experts, named by global index: the merged file an MoE layer loads);
    elsewhere ``state``. A collective: every rank calls it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    keys = [list(state) if rank == 0 else None]
    dist.broadcast_object_list(keys, src=0)
    known = set(keys[0])
    gathered = [None] * world if rank == 0 else None
    dist.gather_object({k: v for k, v in state.items() if k not in known}, gathered, dst=0)
    if rank != 0:
        return state
    merged = dict(state)
    for part in gathered:
        merged.update({k: v for k, v in part.items() if k not in merged})
    return merged


def _per_rank(value: Any) -> Any:
    """On rank 0, every rank's ``value`` (an optimizer's state: its experts' moments are its
    own) as ``{PER_RANK_KEY: [...]}``; elsewhere ``value``. A collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return {PER_RANK_KEY: gathered} if rank == 0 else value


def _own_parts(checkpoint: dict, rank: int, world: int) -> dict:
    """``checkpoint`` with each entry saved per rank replaced by this rank's."""
    out = dict(checkpoint)
    for key, value in checkpoint.items():
        if isinstance(value, dict) and PER_RANK_KEY in value:
            states = value[PER_RANK_KEY]
            if len(states) != world:
                raise ValueError(
                    f"checkpoint entry {key!r} holds the state of each of {len(states)} ranks "
                    f"(an expert-parallel model's optimizer: each rank's experts have their "
                    f"own), but this run has {world} ranks: resume at {len(states)} ranks")
            out[key] = states[rank]
    return out


class _OwnPartsIO:
    """A checkpoint IO that gives this rank its own part of each per-rank entry."""

    def __init__(self, io: Any, rank: int, world: int):
        self._io, self._rank, self._world = io, rank, world

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict:
        return _own_parts(self._io.load_checkpoint(*args, **kwargs), self._rank, self._world)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._io, name)


class _Wrapper(nn.Module):
    """What the reducer attaches to: ``forward`` is the wrapped module's (Lightning redirects
    ``training_step`` through it, as through DDP's wrapper)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _attach(module: nn.Module, process_group, hook, hook_state, options: dict) -> tuple[_Wrapper, Reducer]:
    wrapper = _Wrapper(module)
    return wrapper, _reducer(wrapper, process_group, hook, hook_state, options)


def _reducer(wrapper: _Wrapper, process_group, hook, hook_state, options: dict) -> Reducer:
    reducer = Reducer(wrapper, process_group, **options)
    if hook is not None:
        reducer.register_comm_hook(hook_state, hook)
    return reducer


def _agreed(wants: bool, reducer: Reducer) -> bool:
    """Whether any rank wants a new reducer (one flag, all-reduced: a rebuild runs
    collectives, so every rank must take it; a change made on some ranks only is then named
    by the new reducer's check across ranks, on every rank)."""
    if reducer.world_size == 1:
        return wants
    flag = torch.tensor([float(wants)], device=reducer._device)
    dist.all_reduce(flag, group=reducer.process_group)
    return bool(flag.item())


def _average_pending(params: list, leaving: set, group) -> list:
    """At a rebuild in an accumulation window (a layer frozen between two micro-batches):
    the parameters leaving the averaged set (``leaving``: their ids among the old reducer's
    ``params``, the same list on every rank) keep the gradient of the window's ``no_sync``
    micro-batches, which the new reducer will not average; average it now, as DDP's reducer
    does at the window's end (a parameter no rank has a gradient for keeps none). Returns
    (parameter, averaged gradient) for the caller to set; their ``.grad`` is None here.
    Every rank runs the same collectives, whatever it changed (a change on some ranks only
    is then named by the new reducer's check across ranks)."""
    if not params or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return []
    world = dist.get_world_size(group)
    had = torch.tensor([float(id(p) in leaving and p.grad is not None) for p in params],
                       device=params[0].device)
    dist.all_reduce(had, group=group)
    averaged = []
    for p, used in zip(params, had.tolist()):
        if not used:
            continue
        mine = id(p) in leaving
        g = p.grad if mine else None
        if mine:
            p.grad = None
        dense = torch.zeros_like(p) if g is None else g.to_dense() if g.is_sparse else g.clone()
        wire = torch.view_as_real(dense) if dense.is_complex() else dense  # (in its dtype)
        dist.all_reduce(wire, group=group)
        wire /= world
        if mine:
            averaged.append((p, dense.to_sparse() if g is not None and g.is_sparse else dense))
    return averaged


def _fresh_hook_memory(state: Any) -> None:
    """A rebuild lays out other buckets: torch's PowerSGD keeps its error feedback and
    low-rank factors per bucket index, sized for the old ones; it starts them again, as a
    new ``PowerSGDState`` would (its iteration count kept)."""
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        memory = getattr(state, name, None)
        if isinstance(memory, dict):
            memory.clear()


def _fused_scaler(scaler: torch.amp.GradScaler, device: str) -> torch.amp.GradScaler:
    """A :class:`tribucket.amp.GradScaler` in place of torch's (same settings and state);
    another scaler class (a user's own) is kept."""
    if type(scaler) is not torch.amp.GradScaler:
        return scaler
    fused = GradScaler(device, init_scale=scaler._init_scale, growth_factor=scaler._growth_factor,
                       backoff_factor=scaler._backoff_factor,
                       growth_interval=scaler._growth_interval, enabled=scaler.is_enabled())
    fused.load_state_dict(scaler.state_dict())
    return fused


# ------------------------------------------------------------------------ Lightning Trainer
class _FusedClip:
    """Gradient clipping by norm with :func:`tribucket.clip_grad_norm_` (the norm from the
    reducer's buckets where they hold the gradients unchanged, torch's computation otherwise)."""

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val)


class _Precision(_FusedClip, _PLPrecision):
    """``precision="32-true"`` with the fused clip."""


class _MixedPrecision(_FusedClip, _PLMixed):
    """``precision="16-mixed"``/``"bf16-mixed"`` with the fused clip and, for fp16, the
    reducer's ``found_inf`` in the scaler."""


def _fused_precision(plugin):
    """The precision plugin with tribucket's clip and scaler, for the plugins that have them
    (32-true, 16-mixed, bf16-mixed); any other plugin is used as it is."""
    if type(plugin) is _PLPrecision:
        return _Precision()
    if type(plugin) is _PLMixed:
        scaler = None if plugin.scaler is None else _fused_scaler(plugin.scaler, plugin.device)
        return _MixedPrecision(plugin.precision, plugin.device, scaler=scaler)
    return plugin


class FusedBucketingStrategy(_PLDDPStrategy):
    """Lightning's DDP strategy with :func:`tribucket.fused_bucketing` in place of
    ``DistributedDataParallel``.

    ``Trainer(strategy="tribucket")`` is this class with its defaults. Arguments:

    * ``hook``: ``None`` (averaging allreduce), ``"fp16"``/``"bf16"`` (fused compression),
      ``"allreduce"``, or any comm hook callable (torch's contract), with ``hook_state``;
    * ``**options``: :func:`tribucket.fused_bucketing`'s (``bucket_cap_mb``,
      ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``, ...);
      ``broadcast_buffers`` defaults to ``"ddp"`` here (Lightning evaluates on every rank);
    * ``process_group_backend``, ``timeout``, ``start_method``: as ``DDPStrategy``'s.

    Example::

        trainer = L.Trainer(strategy=FusedBucketingStrategy(hook="fp16", bucket_cap_mb=5),
                            accelerator="cpu", devices=2)
    """

    def __init__(self, hook: str | Callable | None = None, hook_state: Any = None, *,
                 accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision_plugin=None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, start_method: str = "popen",
                 **options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method)
        # Lightning validates on every rank: DDP's buffer rule (rank 0's buffers broadcast
        # before a forward that follows a training one, evaluation included) is safe here
        # and gives DDP's validation metrics (BatchNorm statistics)
        options = {"broadcast_buffers": "ddp", **options}
        self._hook, self._hook_state, self._options = _options(hook, hook_state, options)
        self.reducer: Reducer | None = None  #: the reducer while fitting
        self._restored: dict | None = None  # reducer state read from ckpt_path

    # -- wrapping: the reducer instead of DistributedDataParallel
    def setup(self, trainer: "_pl.Trainer") -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self.precision_plugin = _fused_precision(self.precision_plugin)
        super().setup(trainer)

    def configure_ddp(self) -> None:
        assert isinstance(self.model, _pl.LightningModule)
        self.model, self.reducer = _attach(self.model, None, self._hook, self._hook_state,
                                           self._options)
        if self._restored is not None:
            try:
                self.reducer.load_state_dict(self._restored)
                self._restored = None
            except ValueError:  # saved after a rebuild for another trainable set (a
                pass  # backbone BaseFinetuning unfroze): loaded at the first batch instead

    def _register_ddp_hooks(self) -> None:
        pass  # the comm hook is registered with the reducer in configure_ddp

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # what the model trains changed since the reducer was built (BaseFinetuning unfroze
        # a backbone at an epoch's start, a callback froze a layer or replaced the head):
        # average the new set, as leaving fused_bucketing and entering again does in a loop
        # (run after the callbacks' and the module's on_train_batch_start, on every rank)
        reducer = self.reducer
        if reducer is not None and _agreed(reducer._trains_another_set(), reducer):
            wrapper = self.model
            leaving = {id(p) for p in reducer._leaving()}
            reducer.close()
            self.reducer = None
            averaged = _average_pending(reducer._params, leaving, reducer.process_group)
            _fresh_hook_memory(self._hook_state)
            self.reducer = _reducer(wrapper, None, self._hook, self._hook_state, self._options)
            for p, grad in averaged:  # (after entering: the new reducer sees no stale .grad)
                p.grad = grad
        if self._restored is not None and self.reducer is not None:
            restored, self._restored = self._restored, None
            try:
                self.reducer.load_state_dict(restored)
            except ValueError as e:
                if "for other parameters" not in str(e):
                    raise
                # (BaseFinetuning does not unfreeze again on resume: the checkpoint's
                # reducer was for another trainable set, as DDP's buckets would be)
                _logger.warning("tribucket: the checkpoint's reducer state is for another "
                                "set of trainable parameters (%s); the reducer starts "
                                "afresh (its buckets and hook state are rebuilt)", e)
        super().on_train_batch_start(batch, batch_idx)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        if self.reducer is None:
            yield
        else:
            with self.reducer.no_sync():
                yield

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        # manual optimization: the backward runs inside the wrapper's forward, whose output
        # (the training step's, often None) does not lead to the loss: prepare it from the
        # loss, as Lightning's DDP strategy does for DDP's reducer
        if self.reducer is not None and not self.lightning_module.automatic_optimization:
            self.reducer.prepare_for_backward(closure_loss)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        pass

    def teardown(self) -> None:
        reducer, self.reducer = self.reducer, None
        if isinstance(self.model, _Wrapper):
            self.model = self.model.module
        if reducer is not None:
            reducer.close()
        super().teardown()

    # -- checkpoints: the reducer's state beside the module's
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if self.reducer is not None and "optimizer_states" in checkpoint:  # not weights_only
            checkpoint = {**checkpoint, CHECKPOINT_KEY: self._reducer_state()}
        if self.world_size > 1 and _has_experts(self.lightning_module):
            # every rank's experts and their moments, into the file rank 0 writes
            checkpoint = {**checkpoint,
                          "state_dict": _every_ranks_experts(checkpoint["state_dict"])}
            if "optimizer_states" in checkpoint:
                checkpoint["optimizer_states"] = _per_rank(checkpoint["optimizer_states"])
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _reducer_state(self) -> dict:
        """The reducer's state with every rank's own entries in it (a comm hook's per-rank
        state such as PowerSGD's error feedback; expert reducers'): Lightning writes rank 0's
        checkpoint only, and on resume each rank loads its own entries from it. Every rank
        calls ``save_checkpoint``; the entries travel to rank 0 in one gather."""
        state = self.reducer.state_dict()
        world, rank = self.reducer.world_size, self.reducer.rank
        if world == 1:
            return state
        gathered = [None] * world if rank == 0 else None
        torch.distributed.gather_object(own_entries(state, rank), gathered, dst=0)
        for entries in gathered or ():
            state.update(entries)
        return state

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        checkpoint = _own_parts(super().load_checkpoint(checkpoint_path,
                                                        weights_only=weights_only),
                                self.global_rank, self.world_size)
        self._restored = checkpoint.get(CHECKPOINT_KEY)
        return checkpoint

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("tribucket", cls, description="tribucket.fused_bucketing "
                                   "in place of DDP, processes started as strategy='ddp' does",
                                   override=True)
        strategy_registry.register("tribucket_spawn", cls, description="tribucket, processes "
                                   "started as strategy='ddp_spawn' does", start_method="spawn",
                                   override=True)
        strategy_registry.register("tribucket_find_unused_parameters_true", cls,
                                   description="tribucket with find_unused_parameters=True",
                                   find_unused_parameters=True, override=True)


# ------------------------------------------------------------------------ Lightning Fabric
class _FabricNoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool):
        if not enabled:
            return contextlib.nullcontext()
        reducer = getattr(module, "_tribucket_reducer", None)
        if reducer is None:
            raise TypeError("no_backward_sync needs the module returned by fabric.setup() under "
                            f"strategy='tribucket'; got {type(module).__name__}")
        return reducer.no_sync()


class FusedBucketingFabricStrategy(_FabricDDPStrategy):
    """Fabric's DDP strategy with :func:`tribucket.fused_bucketing` in place of
    ``DistributedDataParallel``; the arguments of :class:`FusedBucketingStrategy`.

    ``fabric.setup(model)`` attaches a reducer (``strategy.reducers[-1]``),
    ``fabric.no_backward_sync(model)`` is its ``no_sync()``, ``fabric.clip_gradients(...,
    max_norm=...)`` is :func:`tribucket.clip_grad_norm_`, and ``precision="16-mixed"`` uses
    :class:`tribucket.amp.GradScaler`.
    """

    def __init__(self, hook: str | Callable | None = None, hook_state: Any = None, *,
                 accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision=None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, start_method: str = "popen",
                 **options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision=precision, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self._hook, self._hook_state, self._options = _options(hook, hook_state, options)
        self._backward_sync_control = _FabricNoSync()
        self.reducers: list[Reducer] = []  #: one per module set up

    @property
    def precision(self):
        return super().precision

    @precision.setter
    def precision(self, precision) -> None:
        if type(precision) is _FabricMixed and precision.scaler is not None:
            precision.scaler = _fused_scaler(precision.scaler, precision.device)
        _FabricDDPStrategy.precision.fset(self, precision)

    def setup_module(self, module: nn.Module) -> nn.Module:
        wrapper, reducer = _attach(module, None, self._hook, self._hook_state, self._options)
        wrapper._tribucket_reducer = reducer
        self.reducers.append(reducer)
        return wrapper

    def get_module_state_dict(self, module: nn.Module) -> dict:
        return super().get_module_state_dict(module.module if isinstance(module, _Wrapper) else module)

    def load_module_state_dict(self, module: nn.Module, state_dict, strict: bool = True) -> None:
        module = module.module if isinstance(module, _Wrapper) else module
        super().load_module_state_dict(module=module, state_dict=state_dict, strict=strict)

    def save_checkpoint(self, path, state: dict, storage_options: Any = None,
                        filter: dict | None = None) -> None:
        modules = {k for k, v in state.items() if isinstance(v, nn.Module)}
        if self.world_size == 1 or not any(_has_experts(state[k]) for k in modules):
            return super().save_checkpoint(path, state, storage_options=storage_options,
                                           filter=filter)
        # every rank's experts and their optimizers' moments, into the file rank 0 writes
        converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
        for key, obj in state.items():
            if key in converted and key in modules:
                converted[key] = _every_ranks_experts(converted[key])
            elif key in converted and isinstance(obj, torch.optim.Optimizer):
                converted[key] = _per_rank(converted[key])
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint=converted, path=path,
                                               storage_options=storage_options)

    def load_checkpoint(self, path, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict:
        io = self.checkpoint_io
        self.checkpoint_io = _OwnPartsIO(io, self.global_rank, self.world_size)
        try:
            return super().load_checkpoint(path, state=state, strict=strict,
                                           weights_only=weights_only)
        finally:
            self.checkpoint_io = io

    def clip_gradients_norm(self, module: nn.Module, optimizer, max_norm, norm_type=2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(self.precision.main_params(optimizer), max_norm,
                               norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    def teardown(self) -> None:
        for reducer in self.reducers:
            reducer.close()
        self.reducers.clear()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("tribucket", cls, description="tribucket.fused_bucketing "
                                   "in place of DDP", override=True)
        strategy_registry.register("tribucket_spawn", cls, description="tribucket, processes "
                                   "started as strategy='ddp_spawn' does", start_method="spawn",
                                   override=True)


FusedBucketingStrategy.register_strategies(_PL_REGISTRY)
FusedBucketingFabricStrategy.register_strategies(_FABRIC_REGISTRY)
del _lf
