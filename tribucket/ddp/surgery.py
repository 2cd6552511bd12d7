"""Parameters and submodules set on a model while a reducer averages it (a head replaced,
LoRA adapters inserted, ``layer.weight = nn.Parameter(...)``).

The reducer averages the parameters the model held on entering. A parameter that starts to
train later would train on each rank's own gradient (torch DDP lets it, silently), and one
that left would be waited for. torch's global registration hooks (fired when a module or a
parameter is assigned to a module, never per step) record such a change on a model being
averaged; the next training forward names it, before any collective."""

from __future__ import annotations

import weakref

from torch import nn
from torch.nn.modules import module as _module

__all__ = ["Watch", "changed_error"]

#: each module of a watched model -> (its model's Watch, the module's qualified name)
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, tuple[Watch, str]]" = weakref.WeakKeyDictionary()
_INSTALLED = False


class Watch:
    """The registration watch on one model, from entering to ``remove()`` (the close)."""

    __slots__ = ("known", "trained", "ignored", "changes", "__weakref__")

    def __init__(self, model: nn.Module, ignored: frozenset = frozenset()):
        global _INSTALLED
        if not _INSTALLED:  # once per process: a dictionary lookup per registration
            _module.register_module_parameter_registration_hook(_on_parameter)
            _module.register_module_module_registration_hook(_on_module)
            _INSTALLED = True
        named = list(model.named_parameters())
        self.known = frozenset(id(p) for _, p in named)  # every parameter on entering
        self.trained = frozenset(id(p) for n, p in named if p.requires_grad and n not in ignored)
        # names ignore_parameters leaves out: a parameter set there trains on each rank
        # alone by design (DDP's test_ddp_ignore_params_arg materialises a module there)
        self.ignored = ignored
        self.changes: list[str] = []  # what was set since entering
        for name, m in model.named_modules():  # (weakly: the model is the user's to drop)
            _OWNERS[m] = (self, name)

    def remove(self) -> None:
        for m in [m for m, (watch, _) in list(_OWNERS.items()) if watch is self]:
            _OWNERS.pop(m, None)

    def _new(self, named) -> bool:
        """Whether any of ``named`` (qualified name, parameter) trains, was not in the model,
        and is not where ``ignore_parameters`` leaves parameters out."""
        return any(t.requires_grad and id(t) not in self.known and n not in self.ignored
                   for n, t in named)

    def _lost(self, old, new) -> bool:
        """Whether a parameter that trained on entering leaves with ``old`` for ``new``."""
        kept = set(map(id, new))
        return any(id(t) in self.trained and id(t) not in kept for t in old)


def _on_parameter(module: nn.Module, name: str, param) -> None:
    _record(module, name, module._parameters, param,
            lambda full: [] if param is None else [(full, param)], "parameter")


def _on_module(module: nn.Module, name: str, sub: nn.Module) -> None:
    _record(module, name, module._modules, sub,
            lambda full: [(f"{full}.{n}", p) for n, p in sub.named_parameters()],
            f"submodule ({type(sub).__name__})")


def _record(module: nn.Module, name: str, where: dict, value, new_params, kind: str) -> None:
    """``value`` is being set as ``module.<name>`` (``where``: the module's dictionary of its
    kind): record it on the watch of the model ``module`` belongs to, if it changes what the
    reducer averages."""
    entry = _OWNERS.get(module)
    if entry is None:
        return None
    watch, prefix = entry
    old = where.get(name)
    if value is old:
        return None
    full = f"{prefix}.{name}" if prefix else name
    new = new_params(full)
    lost = [] if old is None else [old] if isinstance(old, nn.Parameter) else list(old.parameters())
    if watch._new(new) or watch._lost(lost, [t for _, t in new]):
        what, _, detail = kind.partition(" ")
        watch.changes.append(f"{what} {full!r}" + (f" {detail}" if detail else ""))
    return None


def changed_error(changes: list[str]) -> str:
    """The error of a training forward after the model's parameters changed since entering."""
    shown = ", ".join(changes[:6]) + (f" and {len(changes) - 6} more" if len(changes) > 6 else "")
    return ("tribucket: the model's parameters changed after fused_bucketing was entered: "
            f"{shown} was set. The reducer averages the parameters the model held on entering, "
            "so a new one would train on each rank's own gradient and the ranks' models would "
            "drift apart (torch DDP lets them, silently), and one replaced would be waited for "
            "in vain. Change the model (a new head, adapters, a replaced weight) outside the "
            "block: leave fused_bucketing and enter it again (or build a new "
            "DistributedDataParallel), and build the optimizer for the new parameters.")

