"""A per-bucket timeline of the reducer and the MoE layer: record, write, read.

Off by default. When it is off, the code that would record holds ``tracer = None`` and pays
one ``is not None`` check per bucket (per MoE phase); per gradient, nothing in the native
hooks and one comparison in the Python hooks (the first-gradient stamp). When it is on,
a :class:`Tracer` records spans and instants with ``time.perf_counter_ns``, opens a
``torch.profiler`` range for each span (so a user's ``torch.profiler`` trace shows them),
and at :meth:`Tracer.close` rank 0 gathers every rank's events and writes **one** Chrome
trace-event JSON file per run (opens in https://ui.perfetto.dev and ``chrome://tracing``).
``python -m tribucket.trace PATH`` prints the per-bucket table and draws the PNG timeline.

Turning it on: ``make_tracer(trace)`` (``trace`` a path, a directory, ``True``, a
``Tracer``, or ``None``: then the environment variable ``TRIBUCKET_TRACE=DIR`` decides).

The contract: what the reducer and the MoE layer record
=======================================================

Every event has a name, a *lane* (the row it is drawn on; one Chrome ``tid`` per lane),
the rank (the Chrome ``pid``: the global rank) and the step it belongs to (``args.step``,
from :meth:`Tracer.next_step`). Times are ``time.perf_counter_ns`` on the recording rank,
aligned across ranks at close (see :mod:`tribucket.trace.chrome`). ``i`` below is the
bucket's index in reduction order; ``bytes`` is the bucket's size on the wire (elements x
the wire dtype's size).

Reducer, once per synchronised backward pass (the step counts them; a training forward's
events, an MoE layer's, belong to the step of the synchronised pass that follows it,
micro-batches under ``no_sync`` included; an evaluation forward's to the step before):

=========================  =========  =================================================
name                       lane       what, and its args
=========================  =========  =================================================
``backward``               compute    span: the pass's first gradient hook -> end of
                                      backward (the autograd engine's callback). ``{}``
``bucket{i}.first_ready``  compute    instant: the bucket's first gradient is counted
                                      (stamped in C++ by the native hooks, read at its
                                      last). ``{bucket}``
``bucket{i}.last_ready``   compute    instant: its last gradient is counted (the bucket
                                      becomes READY). ``{bucket}``
``bucket{i}.pack``         compute    span: the fused pack. ``{bucket, bytes}``
``bucket{i}.allreduce``    comm       span: the collective in flight, from its launch to
                                      the moment the backend completes it (a callback on
                                      its future; see :meth:`Tracer.collective`), whatever
                                      carries it (the reducer's allreduce or a comm hook's
                                      future). ``{bucket, bytes}``; a bucket sent in chunks
                                      has one span per chunk, with ``chunk`` added.
``bucket{i}.wait``         compute    span: the reducer waits for it. ``{bucket}``
``bucket{i}.unpack``       compute    span: the result becomes ``.grad`` (unpack or lend).
                                      ``{bucket}``
``status``                 compute    span (optional): waiting for the end-of-backward
                                      status when it is sent on its own. ``{}``
``epilogue``               compute    span: one use of the gradients' figures after
                                      backward. ``{op}``: ``grad_norm``, ``found_inf``,
                                      ``clip_grad_norm_`` or ``unscale_`` (GradScaler)
``optimizer.step``         compute    span: ``ShardedOptimizer.step``. ``{}``
``layout``                 compute    instant: a (re)built layout. ``{buckets: [bytes...]}``
=========================  =========  =================================================

MoE layer, per forward (``args = {layer}``, the layer's name):

``moe.counts`` (routing and the counts exchange), ``moe.dispatch`` (the token exchange,
with the shared experts beside it), ``moe.experts`` (the experts; ``schedule="alltoall"``
without shadows: the pipelined schedules interleave them with the exchange, inside
``moe.dispatch``), ``moe.combine`` (the return exchange and the weighted sum), spans on lane
``moe``; ``moe.backward``: an instant where the layer's backward begins; then, recorded with
:meth:`Tracer.backward_range` (the all-to-all schedule), ``moe.combine.bwd``,
``moe.experts.bwd`` and ``moe.dispatch.bwd``, each from the gradient of its forward
region's output to that of its input.

Order guaranteed per bucket and step (what the tests check and the table relies on):
``first_ready <= last_ready <= pack <= allreduce start <= allreduce end <= wait end``.

Other names are allowed (the table ignores them; the PNG draws them grey).
"""

from __future__ import annotations

from .chrome import load, validate
from .tracer import (COMM, COMPUTE, DEVICE, DEVICE_COMM, DEVICE_ENV, ENV, MOE, Tracer, current,
                     make_tracer)

__all__ = ["COMM", "COMPUTE", "DEVICE", "DEVICE_COMM", "DEVICE_ENV", "ENV", "MOE", "Tracer",
           "current", "load", "make_tracer", "validate"]
