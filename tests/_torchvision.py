"""Make ``import torchvision`` work next to the CPU build of torch.

The only torchvision wheels the package registry has for Linux are built against CUDA torch:
their C++ ops library (``torchvision/_C.so``: nms, roi_align, ...) links ``libtorch_cuda`` and
does not load next to ``torch==2.13.0+cpu``. torchvision copes with that for every op but two:
its import registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``
unconditionally, and raises ``RuntimeError: operator torchvision::nms does not exist``. Lightning
(through torchmetrics) and timm import torchvision, so they fail the same way.

:func:`ensure_importable` declares those two schemas, without kernels, when the library does not
load, before torchvision is imported; the models the suite builds (resnet18, timm's ViT) and
Lightning use none of torchvision's C++ ops. With a torchvision whose ops load (a CPU wheel, a
CUDA machine) it does nothing. Call it before anything imports torchvision, lightning or timm.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

_MISSING_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
)
_lib = None  # the Library holding the declared schemas (kept alive for the process)


def ensure_importable() -> None:
    """Declare torchvision's two unguarded ops when its C++ library cannot load."""
    global _lib
    if _lib is not None or "torchvision" in sys.modules:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: the importer gets the usual ImportError
    path = os.path.join(list(spec.submodule_search_locations)[0], "_C.so")
    try:
        torch.ops.load_library(path)
        return  # the ops are there: torchvision imports as it is
    except (OSError, ImportError):
        pass
    _lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _MISSING_SCHEMAS:
        _lib.define(schema)
