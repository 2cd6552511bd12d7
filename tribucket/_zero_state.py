"""ShardedOptimizer's checkpoints (``tribucket.zero``): its state-dict methods
(:class:`StateDicts`), the per-rank shard format, and merging every rank's shards into
torch's whole-model structure."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_FORMAT = "tribucket.zero/1"
#: the state key of a float16/bfloat16 parameter's fp32 master copy, in the state dicts
MASTER_KEY = "fp32_master"


#: the per-parameter scalars of the elementwise torch optimizers' states (a 0-dim
#: parameter's own moments are 0-dim too: told apart by name)
_SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


def _param_shaped(key: str, v: Any, shape: tuple) -> bool:
    """Whether state entry ``v`` holds one value per element of a parameter of ``shape``."""
    return isinstance(v, torch.Tensor) and key not in _SCALAR_KEYS and tuple(v.shape) == shape


def _check_format(state: Any) -> None:
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError("not a sharded optimizer state saved by "
                         "ShardedOptimizer.sharded_state_dict() (no 'format': "
                         f"{_FORMAT!r}); a whole-model state loads with load_state_dict()")


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def merge_sharded_state_dicts(shards: list[dict]) -> dict:
    """Merge every rank's :meth:`ShardedOptimizer.sharded_state_dict` into the whole-model
    state (torch's structure), e.g. to load it at another world size. No communication."""
    for s in shards:
        _check_format(s)
    world = shards[0]["world_size"] if shards else 0
    ranks = sorted(s["rank"] for s in shards)
    if ranks != list(range(world)) or any(s["world_size"] != world for s in shards):
        raise ValueError(f"need the shards of every rank of one run: got ranks {ranks} of "
                         f"world sizes {sorted({s['world_size'] for s in shards})}")
    first = shards[0]
    shapes = first["param_shapes"]
    state: dict[int, dict] = {}
    for s in shards:
        inner = s["optimizer"]["state"]
        for j, (length, pieces) in enumerate(s["segments"]):
            st = inner.get(j)
            if not st:
                continue
            for u, p_start, s_start, n in pieces:
                dst = state.setdefault(u, {})
                for key, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == length \
                            and key not in _SCALAR_KEYS:
                        full = dst.get(key)
                        if full is None:
                            full = dst[key] = torch.zeros(_numel(shapes[u]), dtype=v.dtype,
                                                          device=v.device)
                        full[p_start:p_start + n] = v[s_start:s_start + n]
                    elif p_start == 0 or key not in dst:  # scalars: the first element's
                        dst[key] = v.clone() if isinstance(v, torch.Tensor) else v
    for u, dst in state.items():
        for key, v in dst.items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and key not in _SCALAR_KEYS \
                    and v.numel() == _numel(shapes[u]):
                dst[key] = v.view(shapes[u])
    for s in shards:  # parameters without a shard (frozen): their state as loaded
        for u, dst in s.get("unsharded_state", {}).items():
            state.setdefault(u, dst)
    groups = []
    for saved, members in zip(first["optimizer"]["param_groups"], first["param_groups"]):
        groups.append({**{k: v for k, v in saved.items() if k != "params"},
                       "params": list(members)})
    return {"state": {u: state[u] for u in sorted(state)}, "param_groups": groups}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class StateDicts:
    """:class:`tribucket.zero.ShardedOptimizer`'s checkpoints: this rank's shard
    (``sharded_state_dict``) and torch's whole-model state (``state_dict``), each loaded
    back. A part of ``ShardedOptimizer``: it reads the optimizer's own attributes."""

    def sharded_state_dict(self) -> dict:
        """This rank's part of the optimizer state (no communication): save one per rank,
        load it with :meth:`load_sharded_state_dict` at the same world size, or merge all
        ranks' with :func:`merge_sharded_state_dicts`."""
        self.wait_parameters()
        self._take_written_parameters()
        self._options_down()
        optimizer = self.optim.state_dict()
        # a low-precision slice's fp32 master travels with its state (as in Megatron's
        # distributed optimizer): the parameters hold only its rounding
        for j, seg in enumerate(self._inner):
            if seg is not None and self._seen[seg.bucket] is not None and \
                    optimizer["state"].get(j):
                optimizer["state"][j] = {**optimizer["state"][j],
                                         MASTER_KEY: seg.tensor.detach().clone()}
        return {
            "format": _FORMAT,
            "world_size": self._world,
            "rank": self._rank,
            "optimizer": optimizer,
            # per wrapped-optimizer tensor: its length and the parameter pieces it holds
            "segments": [(0, []) if s is None else (s.length, list(s.pieces))
                         for s in self._inner],
            "param_shapes": [tuple(p.shape) for p in self._user_params],
            "param_groups": [list(g) for g in self._user_groups],
            # (the same on every rank: rank 0's is the merged one)
            "unsharded_state": _to_cpu(self._parked) if self._rank == 0 else {},
        }

    def load_sharded_state_dict(self, state: dict) -> None:
        """Load what :meth:`sharded_state_dict` saved on this rank."""
        self.wait_parameters()
        _check_format(state)
        if state["world_size"] != self._world:
            raise ValueError(
                f"this optimizer shard was saved at world size {state['world_size']} (rank "
                f"{state['rank']}) but this run has world size {self._world}: a shard loads "
                "only at the world size it was saved at. To reshard, merge the shards of every "
                "rank with tribucket.zero.merge_sharded_state_dicts([...]) and load the "
                "result with load_state_dict()")
        if state["rank"] != self._rank:
            raise ValueError(f"this optimizer shard belongs to rank {state['rank']}; rank "
                             f"{self._rank} must load its own")
        mine = self.sharded_state_dict()
        if state["segments"] != mine["segments"] or state["param_shapes"] != \
                mine["param_shapes"]:
            raise ValueError("this optimizer shard was saved for other parameters or another "
                             "bucket layout (model, param groups or bucket_cap_mb differ); "
                             "save and load with state_dict()/load_state_dict() instead")
        self._load_inner(state["optimizer"])
        self._parked = dict(state.get("unsharded_state", {}))
        self._options_up()

    def _load_inner(self, inner: dict) -> None:
        """Load the wrapped optimizer's state; the fp32 master slices saved in it go into
        the masters (checked against the parameters at the next step: see
        :meth:`_take_written_parameters`)."""
        entries = dict(inner["state"])
        for j, entry in inner["state"].items():
            seg = self._inner[j] if j < len(self._inner) else None
            if MASTER_KEY in entry:
                entries[j] = {k: v for k, v in entry.items() if k != MASTER_KEY}
                if seg is not None and self._seen[seg.bucket] is not None:
                    seg.tensor.copy_(entry[MASTER_KEY].reshape(-1))
        self.optim.load_state_dict({**inner, "state": entries})
        self._seen = [None if v is None else -1 for v in self._seen]  # checked at the step

    def _uneven_segment_states(self, saved_state: dict, ids: list) -> str | None:
        """Why ``saved_state`` cannot load: two parameters that may share a flat segment
        (neighbours in a bucket, one param group), which keeps one value of each scalar such
        as ``step``, whose saved scalars differ, or one with state and one without. Read
        from the whole layout, so every rank finds the same."""
        cfg = self.reducer.config
        if cfg.find_unused_parameters or cfg.static_graph:
            return None  # one segment per parameter
        names = {id(p): n for n, p in self.reducer.module.named_parameters()}

        def scalars(u):
            return _scalars(saved_state.get(ids[u]), tuple(self._user_params[u].shape))

        for bucket in self.reducer.layout.buckets:
            prev = None
            for i in bucket.indices:
                here = self._where.get(i)
                if here is not None and prev is not None and prev[0] == here[0] and \
                        scalars(prev[1]) != scalars(here[1]):
                    a, b = (self._user_params[u] for u in (prev[1], here[1]))
                    said = ["no state" if v is None else ", ".join(f"{k}={x}" for k, x in v)
                            for v in (scalars(prev[1]), scalars(here[1]))]
                    return (f"ShardedOptimizer.load_state_dict: parameters "
                            f"{names.get(id(a), '?')!r} ({said[0]}) and "
                            f"{names.get(id(b), '?')!r} ({said[1]}) of param group {here[0]} "
                            "may share a flat segment of the wrapped optimizer, which keeps "
                            "one value of each such scalar per segment; a torch optimizer "
                            "steps them apart (a parameter without state, frozen or unused "
                            "until now, starts fresh). Enter fused_bucketing with "
                            "find_unused_parameters=True (a segment per parameter), or put "
                            "them in separate param groups")
                prev = here
        return None

    def state_dict(self) -> dict:
        """The whole-model state in torch's structure (as ``optimizer_class`` over the same
        param groups would give it; fp32 state for fp16/bf16 parameters, each with its fp32
        master copy under ``"fp32_master"``), gathered from
        every rank: call on every rank; every rank gets it. Runs the hooks of
        ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook``, as torch's."""
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        local = _to_cpu(self.sharded_state_dict())
        every: list = [None] * self._world
        if self._world > 1:
            self._guard.mark_call("opt.state_dict()")
            self._bounded(lambda: dist.all_gather_object(every, local, group=self._group),
                          "state_dict all-gather")
        else:
            every = [local]
        state = merge_sharded_state_dicts(every)
        for saved, mine in zip(state["param_groups"], self._groups):
            saved.update(_names(mine))  # as torch's state of named parameters has them
        for post in self._optimizer_state_dict_post_hooks.values():
            state = _hooked(post(self, state), state)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole-model state (from :meth:`state_dict` at any world size, or from a
        torch optimizer of the same class over the same param groups). Runs the hooks of
        ``register_load_state_dict_pre_hook`` / ``..._post_hook``, as torch's."""
        state = state_dict
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            state = _hooked(pre(self, state), state)
        self.wait_parameters()
        saved_groups = state.get("param_groups")
        if not isinstance(saved_groups, list) or "state" not in state:
            raise ValueError("expected a torch optimizer state dict with 'state' and "
                             "'param_groups'")
        if len(saved_groups) != len(self._user_groups):
            raise ValueError(f"the state has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self._user_groups)}")
        ids = []
        for g, (saved, mine) in enumerate(zip(saved_groups, self._user_groups)):
            if len(saved["params"]) != len(mine):
                raise ValueError(f"param group {g}: the state has {len(saved['params'])} "
                                 f"parameters, this optimizer {len(mine)}")
            ids += list(saved["params"])
        saved_state = state["state"]
        problem = self._uneven_segment_states(saved_state, ids)
        if problem is not None:  # (the same on every rank: read from the whole layout)
            raise ValueError(problem)
        inner_state = {}
        for j, seg in enumerate(self._inner):
            if seg is None:
                continue
            entry: dict = {}
            for u, p_start, s_start, n in seg.pieces:
                st = saved_state.get(ids[u])
                if not st:
                    continue
                shape = tuple(self._user_params[u].shape)
                for key, v in st.items():
                    if _param_shaped(key, v, shape):
                        buf = entry.get(key)
                        if buf is None:
                            buf = entry[key] = torch.zeros(seg.length, dtype=v.dtype)
                        buf[s_start:s_start + n] = v.detach().reshape(-1)[p_start:p_start + n]
                    elif key not in entry:
                        entry[key] = v.clone() if isinstance(v, torch.Tensor) else v
            if entry:
                inner_state[j] = entry
        self._parked = {u: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                            for k, v in saved_state[ids[u]].items()}
                        for u in self._unsharded if saved_state.get(ids[u])}
        inner_groups, k = [], 0
        for saved, group in zip(saved_groups, self.optim.param_groups):
            n = len(group["params"])
            inner_groups.append({**_options(saved), "params": list(range(k, k + n))})
            k += n
        self._load_inner({"state": inner_state, "param_groups": inner_groups})
        self._options_up()
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)


def _scalars(st: dict | None, shape: tuple) -> tuple | None:
    """A parameter's saved scalars (``step``, ...) as comparable values; None: no state."""
    if not st:
        return None
    return tuple(sorted((k, v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
                        for k, v in st.items() if not _param_shaped(k, v, shape)))


def _options(group: dict) -> dict:
    """A param group's options: everything but its parameters and their names (the shard
    groups hold slices, which have none)."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _names(group: dict) -> dict:
    """The group's ``param_names`` entry, if it was given named parameters."""
    return {"param_names": list(group["param_names"])} if "param_names" in group else {}


def _hooked(out: Any, state: dict) -> dict:
    """A state-dict hook may return a replacement (torch's contract) or None."""
    return state if out is None else out
