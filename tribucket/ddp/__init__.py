"""Data parallelism: the reducer that averages gradients across ranks, one bucket at a time.

Files, in the order one gradient meets them:

* ``backward.py``: the post-accumulate-grad hook marks the gradient ready and counts it down
  in its bucket; complete buckets are launched in bucket order; the end of backward;
* ``bucket.py``: one object per bucket: pack, communicate (allreduce or comm hook), wait,
  finish (the averaged buffer becomes ``.grad``);
* ``memory.py``: a bucket's buffers and the ``.grad`` views lent out of them;
* ``tribucket.kernels``: the fused pack/unpack.

Around them: ``reducer.py`` (the public ``Reducer``: attaching, ``no_sync``, comm hooks,
``close``), ``forward.py`` (its forward hooks: buffers, ``no_sync``, the end-of-backward
callback), ``allocate.py`` (building the buckets of a layout), ``state.py`` (one backward pass, ``ReducerStats``), ``status.py`` (the
end-of-backward agreement), ``settle.py`` (passes that end without a normal backward: Join
shadow passes, a backward that raised, a step a torchft replica group gave up), ``rebuild.py`` (which layout), ``join.py`` (uneven inputs),
``resume.py`` (checkpoints), ``model.py`` (which parameters, the same on every rank),
``watchdog.py`` (timeouts, debug fingerprints), ``claims.py`` (one live reducer per
parameter), ``hookcall.py`` (calling comm hooks), ``graph.py`` (which parameters a
forward reached), ``compat.py`` (DDP's spellings: ``join()``, the options as
attributes, ``logging_data()``).
"""

from .reducer import Reducer, fused_bucketing
from .state import ReducerStats

__all__ = ["Reducer", "ReducerStats", "fused_bucketing"]
