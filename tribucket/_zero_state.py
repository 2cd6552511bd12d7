"""ShardedOptimizer's checkpoint helpers: the per-rank shard format and merging every
rank's shards into torch's whole-model structure (``tribucket.zero``)."""

from __future__ import annotations

from typing import Any

import torch

_FORMAT = "tribucket.zero/1"


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
