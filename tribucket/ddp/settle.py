"""The passes of the data-parallel reducer that end without a normal backward: a Join
shadow pass (a rank out of inputs contributes zeros), a backward that raised and is settled
(its owed collectives sent with zeros and a failure status), one that raised before reaching
the model, and, with a torchft manager, the synchronised pass of a step a replica group gave
up. Each issues the collectives its peers expect, in their order, so no rank is left
waiting, and reports the failure through the end-of-backward status (``status.py``).

:class:`Settle` is a part of :class:`~tribucket.ddp.backward.Backward` (its state and
helpers: buckets, status exchange, the pass in flight); it lives here to keep the normal
path of ``backward.py`` readable.
"""

from __future__ import annotations

from .state import Pass

__all__ = ["Settle"]


class Settle:
    """Ending passes that did not end normally (mixed into ``Backward``)."""

    def shadow_pass(self, failed: str | None = None) -> None:
        """A Join shadow pass: send zeros in every bucket, agree on the status, discard.
        ``failed``: the synchronised pass of a step this replica group gave up (a backward
        under no_sync raised), whose status reports ``failed`` (with a torchft manager)."""
        if self.agree_pending:
            self.agree_on_state()  # as the first backward of the ranks still training
        if not self.allocated:
            self.allocate()
        p = Pass(True, len(self.params), self.passes)
        p.shadow = failed is None
        p.errors += [failed] if failed else []  # (before the launch: the status rides it)
        self.synced += 1
        if self.comm.tracer is not None:  # (the step of the ranks still training)
            self.comm.tracer.next_step(self.synced)
        for bucket in self.buckets:
            bucket.reset()
            bucket.launch(p, self.comm, zeros=True)
        cfg = self.config
        used = self._local_used(p)
        _, status, _ = self._exchange_status(p, len(p.errors), used)
        if failed:
            return self._forget_nosync_used()
        self._resolve_pending(f"the Join shadow pass of iteration {p.iteration}")
        if used is not None and cfg.static_graph:
            self.static_used = self.status.used(status)
        if cfg.static_graph and self.static_counts is None:
            self.static_counts = [1] * len(self.params)
        self.stats.iterations += 1
        if self.policy.may_rebuild(self.rebuilt) and not (
                cfg.static_graph and self.stats.iterations < 2):
            self.rebuild(list(range(len(self.params))))
        if self.tuner is not None:  # bucket_cap_mb="auto": a step, not measured (autotune.py)
            self.tuner.after_step(self, None)

    def finish_in_flight(self, abandon: bool = False) -> Exception | None:
        """``close()``: settle the pass left unfinished (see :meth:`settle_abandoned`) so no
        peer is left waiting; the error that raised, if any. ``abandon``: drop it instead
        (an interrupt: the process ends, and the peers' passes need not pair)."""
        if self.guard.failed or abandon:
            self.pass_ = self.skip_pending = self.pending_status = None
            return None
        try:
            if self.pass_ is not None:
                self.settle_abandoned()
            self._drop_skip_agreement()  # a forward that no backward followed
        except Exception as e:  # noqa: BLE001 - reported by close()
            return e
        return self._resolve_pending("close()", swallow=True)

    def settle_abandoned(self) -> None:
        """Finish a backward pass that raised before its end (a user hook, autograd): issue
        the collectives it still owed, with zeros, and a status that reports the failure, so
        peers whose backward completed raise ("another rank reported a problem") instead of
        pairing these collectives with the next pass's. This rank's user has seen the
        exception already; the next pass starts clean on every rank."""
        p, self.pass_ = self.pass_, None
        self.native.end(self.buckets)
        if p is not None and not p.sync and self.comm.drop_step is not None:
            # with a manager the other groups' step still has its synchronised pass, which
            # this group gives up: send it now, zeros and the failure, so all drop the step
            failed = (f"a backward under no_sync (iteration {p.iteration}) raised on this "
                      "replica group: this step is dropped")
            self.shadow_pass(failed)
            self.comm.drop_step(failed)
        if p is None or not p.sync:
            return  # a no_sync pass issues no collective
        if not p.any_ready:
            p.any_ready = True
            self._first_gradient(p)
        p.errors.append(f"the previous backward pass (iteration {p.iteration}) raised on "
                        f"rank {self.rank} before its end")
        self.ready_order = []  # the order of a broken pass is no base for the rebuild
        for b in range(p.next_bucket, len(self.buckets)):
            self._launch(p, self.buckets[b])
        p.next_bucket = len(self.buckets)
        _, status, _ = self._exchange_status(p, self._missing(p) + len(p.errors),
                                             self._local_used(p))
        self._forget_nosync_used()
        if self.comm.drop_step is not None:  # (after the collectives: a manager that knows
            self.comm.drop_step(  # of an error sends nothing more)
                f"backward iteration {p.iteration} raised on this replica group before its "
                "end: this step is dropped")
        # this rank's user has an error already; a deferred pass's report would be a second
        self._resolve_pending(f"backward iteration {p.iteration}", swallow=True)
        try:
            self._check_steps(status)
        except RuntimeError:
            pass  # the counts are aligned again

    def _check_steps(self, status) -> None:
        """Raise on every rank if the ranks are in the backward of different training steps;
        every rank then counts its forwards afresh from here, together, so the steps after
        the one that raised are compared (and averaged) as usual."""
        try:
            self.status.check_steps(status)
        except RuntimeError:
            self.forwards = 0
            self.opt_base = self.opt_steps
            raise

    def settle_unbegun(self) -> None:
        """The last training forward's backward raised before any hook of the reducer ran
        (in the loss's backward, before the model's output): settle it as
        :meth:`settle_abandoned` does a pass that began. Nothing to do when a pass is under
        way (it is settled), or when no forward awaits its backward."""
        if self.pass_ is None and self.fwd_sync:
            self._begin_pass()
        elif self.pass_ is None:
            self.fwd_sync = None
            return
        self.settle_abandoned()
