"""Parameters and submodules set on a model while a reducer averages it (a head replaced,
LoRA adapters inserted, ``layer.weight = nn.Parameter(...)``).

The reducer averages the parameters the model held on entering. A parameter that starts to
train later would train on each rank's own gradient (torch DDP lets it, silently), and one
that left would be waited for. torch's global registration hooks (fired when a module or a
parameter is assigned to a module, never per step) mark a watched model as touched; the next
training forward then compares the model's parameters with the reducer's, once, and names
what changed, before any collective. ``nn.Sequential.insert`` and ``nn.ModuleList.insert``
write into the container's ``_modules`` themselves, past those hooks: the forward also
compares the containers' lengths (a few integers). ``model.to(...)`` under torch's
``set_overwrite_module_params_on_conversion(True)`` replaces every parameter in its module's
``_parameters`` dictionary, past those hooks too: the forward also looks up the first and
the last averaged parameter where they were (two dictionary lookups). What
``torch.func.functional_call`` swaps in for one call (MAML's fast weights, computed from the
parameters, whose gradients reach them; a teacher's parameters) is no change: the check is
left for the first forward outside such a call (a miss inside one looks up the calling
frames), and a plain tensor found in ``_parameters`` is never taken for a parameter. Other
writes into a module's ``_modules`` or ``_parameters`` dictionaries themselves are not
seen."""

from __future__ import annotations

import sys
import weakref

from torch import nn
from torch.nn.modules import module as _module

__all__ = ["Watch", "changed_error"]

#: each module of a watched model -> {the Watch of each model holding it: its qualified
#: name there} (a module two watched models share, a frozen feature extractor, has two)
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
_INSTALLED = False
_CONTAINERS = (nn.Sequential, nn.ModuleList)  # (their insert writes _modules directly)


class Watch:
    """The registration watch on one model, from entering to ``remove()`` (the close).

    ``frozen``: the reducer's list of (name, parameter) that did not require grad on
    entering, whose unfreezing the forward refuses; a frozen parameter added since joins it.
    ``ignored``: the names ``ignore_parameters`` leaves out (a parameter set there trains on
    each rank alone by design, as DDP's ``test_ddp_ignore_params_arg`` materialises one)."""

    __slots__ = ("model", "known", "trained", "ignored", "frozen", "removal_matters", "touched",
                 "changes", "sizes", "ends", "__weakref__")

    def __init__(self, model: nn.Module, frozen: list, ignored: frozenset = frozenset(),
                 removal_matters: bool = True):
        global _INSTALLED
        if not _INSTALLED:  # once per process: a dictionary lookup per registration
            _module.register_module_parameter_registration_hook(_touched)
            _module.register_module_module_registration_hook(_touched)
            _INSTALLED = True
        named = list(model.named_parameters())
        self.model = weakref.ref(model)  # (the model is the user's to drop)
        self.known = frozenset(id(p) for _, p in named)  # every parameter on entering
        self.trained = {id(p): n for n, p in named if p.requires_grad and n not in ignored}
        self.ignored, self.frozen = ignored, frozen
        # a parameter gone from the model is waited for, unless the reducer looks for unused
        # ones (find_unused_parameters: it is then unused, as under DDP)
        self.removal_matters = removal_matters
        self.touched = False  # a module or parameter was set on the model since the check
        self.changes: list[str] = []  # what the last check found
        self.sizes: list[tuple[weakref.ref, int]] = []  # (container, its length)
        #: (module, name, id) of the first and the last averaged parameter where they are held
        self.ends: list[tuple[weakref.ref, str, int]] = []
        self._own(model)

    def _own(self, model: nn.Module) -> None:
        for name, m in model.named_modules():  # (those set since too: a container filled)
            _OWNERS.setdefault(m, {})[self] = name
        self.sizes = [(weakref.ref(m), len(m._modules)) for m in model.modules()
                      if isinstance(m, _CONTAINERS)]
        held = [(m, n, p) for m in model.modules() for n, p in m._parameters.items()
                if p is not None and id(p) in self.trained]
        if held or not self.ends:  # (inside a functional_call: the ends kept)
            self.ends = [(weakref.ref(m), n, id(p)) for m, n, p in (held[:1] + held[-1:])]

    def resized(self) -> bool:
        """Whether a container's length changed since the check (``insert`` writes past
        torch's registration hooks), or the first or the last averaged parameter is no longer
        where it was (``model.to(...)`` under torch's overwrite-on-conversion flag)."""
        for ref, n in self.sizes:
            m = ref()
            if m is not None and len(m._modules) != n:
                return True
        for ref, name, pid in self.ends:
            m = ref()
            if m is not None and id(p := m._parameters.get(name)) != pid and (
                    p is None or isinstance(p, nn.Parameter)):  # (else: a functional_call)
                return True
        return False

    def check(self) -> list[str]:
        """Compare the model's parameters with those on entering (after a registration):
        new ones that train, and averaged ones no longer in the model. Inside a
        ``functional_call`` nothing is compared (what it swapped in leaves after the call):
        the next forward outside one compares."""
        if _in_functional_call():
            self.touched = True
            return []
        self.touched = False
        model = self.model()
        if model is None:
            return self.changes
        named = list(model.named_parameters())
        here = {id(p) for _, p in named}
        # plain tensors: swapped in by torch.func.functional_call for one call (module doc)
        swapped = {n for n, p in named if not isinstance(p, nn.Parameter)}
        new = [n for n, p in named if p.requires_grad and id(p) not in self.known
               and n not in self.ignored and n not in swapped]
        gone = [n for i, n in self.trained.items() if i not in here and n not in swapped]
        if not self.removal_matters:  # (replaced ones still count: see new)
            gone = [n for n in gone if n in new]
        # the frozen list: those still in the model, and frozen newcomers (a frozen module
        # taken out and trained elsewhere is no longer this model's)
        listed = {id(p) for _, p in self.frozen}
        self.frozen[:] = [(n, p) for n, p in self.frozen if id(p) in here] + [
            (n, p) for n, p in named if not p.requires_grad and id(p) not in self.known
            and id(p) not in listed and n not in swapped]
        replaced = [n for n in new if n in gone]
        self.changes = ([f"replaced {_listed(replaced)}"] if replaced else []) + (
            [f"added {_listed([n for n in new if n not in replaced])}"]
            if len(new) > len(replaced) else []) + (
            [f"removed {_listed([n for n in gone if n not in replaced])}"]
            if len(gone) > len(replaced) else [])
        self._own(model)
        return self.changes

    def remove(self) -> None:
        for m, watches in list(_OWNERS.items()):
            if watches.pop(self, None) is not None and not watches:
                _OWNERS.pop(m, None)


def _in_functional_call() -> bool:
    """Whether a frame of torch's ``functional_call`` (``torch.func.functional_call`` and
    ``torch.nn.utils.stateless.functional_call`` both run the module inside
    ``stateless._functional_call``) is on the stack."""
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if code.co_name == "_functional_call" and code.co_filename.endswith("stateless.py"):
            return True
        f = f.f_back
    return False


def _touched(module: nn.Module, name: str, value) -> None:
    for watch in _OWNERS.get(module, ()):
        watch.touched = True
    return None


def _listed(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:8]) + (
        f" and {len(names) - 8} more" if len(names) > 8 else "")


def changed_error(changes: list[str]) -> str:
    """The error of a training forward after the model's parameters changed since entering."""
    return ("tribucket: the model's parameters changed after the reducer was built "
            "(fused_bucketing entered, or DistributedDataParallel built): "
            f"{'; '.join(changes)}. The reducer averages the parameters the model held on "
            "entering, so a new one would train on each rank's own gradient and the ranks' "
            "models would drift apart (torch DDP lets them, silently), and one gone would be "
            "waited for in vain. Change the model (a new head, adapters, a replaced weight) "
            "outside the block: leave fused_bucketing and enter it again (or build a new "
            "DistributedDataParallel), and build the optimizer for the new parameters.")
