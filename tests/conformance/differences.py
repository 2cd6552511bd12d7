"""Why a test of torch's that DDP passes fails through ``tribucket.DistributedDataParallel``.

One entry per such test: the kind, and what a user reads in docs/conformance.md.
"""

from __future__ import annotations

from typing import NamedTuple


class Reason(NamedTuple):
    #: "internal": the test reads a DDP-private field, log string or C++ object (named);
    #: "documented": tribucket behaves differently on purpose (the link says how and why);
    #: "open": a tribucket defect not fixed yet (with a minimal reproduction)
    kind: str
    text: str


REASONS: dict[str, Reason] = {}
