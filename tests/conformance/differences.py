"""Why a test of torch's that DDP passes fails through ``tribucket.DistributedDataParallel``.

One entry per such test: the kind, and what a user reads in docs/conformance.md. ``run.py``
fails when a test fails through the class while DDP passes and has no entry here; an entry
whose test passes is simply not shown.
"""

from __future__ import annotations

from typing import NamedTuple


class Reason(NamedTuple):
    #: "internal": the test reads a DDP-private method, field, log field or message (named);
    #: "documented": tribucket behaves differently on purpose (the link says how and why);
    #: "open": a tribucket defect not fixed yet (with a minimal reproduction)
    kind: str
    text: str


_CLASS = "[data-parallel.md](data-parallel.md#tribucketdistributeddataparallel-ddps-shape)"
_LOGGING = "[`logging_data()`](data-parallel.md#ddps-methods-and-attributes)"
_MISSING = "[unused and missing gradients](data-parallel.md#unused-and-missing-gradients)"

REASONS: dict[str, Reason] = {
    # ---- documented differences
    "test_ddp_static_graph_nested_types": Reason(
        "documented", "wraps a DDP inside a DDP over the same parameters: a parameter is "
        f"averaged by one reducer at a time, so the inner wrapper is refused, naming it ({_CLASS})"),
    "test_ddp_native_mixed_precision_ignored_params": Reason(
        "documented", f"passes DDP's `mixed_precision`, refused by name ({_CLASS})"),
    # ---- DDP internals
    "test_ddp_broadcast_buffer_via_hook": Reason(
        "internal", "calls DDP's private `_register_buffer_comm_hook`"),
    "test_ddp_buffer_hook_allreduce": Reason(
        "internal", "calls DDP's private `_register_buffer_comm_hook`"),
    "test_ddp_buffer_hook_allreduce_return_future": Reason(
        "internal", "calls DDP's private `_register_buffer_comm_hook`"),
    "test_ddp_broadcast_buffers_deprecation_warning": Reason(
        "internal", "expects DDP's `FutureWarning` deprecating its own `broadcast_buffers` "
        "argument, which tribucket keeps"),
    "test_ddp_build_debug_param_to_name_mapping": Reason(
        "internal", "calls DDP's private `_build_params_for_reducer` and "
        "`_build_debug_param_to_name_mapping`"),
    "test_ddp_build_debug_param_to_name_mapping_requires_grad": Reason(
        "internal", "calls DDP's private `_build_params_for_reducer` and "
        "`_build_debug_param_to_name_mapping`"),
    "test_ddp_comm_hook_logging": Reason(
        "internal", "expects the log field `comm_hook` to read `BuiltinCommHookType.ALLREDUCE` "
        "(the name of DDP's C++ built-in hook); tribucket logs the hook it runs, "
        "`allreduce_hook`"),
    "test_ddp_control_flow_different_across_ranks": Reason(
        "internal", "reads the C++ reducer's `ddp.reducer._get_local_used_map()`"),
    "test_ddp_control_flow_same_across_ranks": Reason(
        "internal", "reads the C++ reducer's `ddp.reducer._get_local_used_map()`"),
    "test_detect_ddp_is_actually_static": Reason(
        "internal", "reads the C++ reducer's `ddp.reducer._ddp_graph_static()`"),
    "test_ddp_logging_data_cpu": Reason(
        "internal", "reads `forward_compute_time` and DDP's sampling of runtime figures "
        f"(the first 10 iterations, then one in the sample rate) from its log; tribucket's {_LOGGING} "
        "is current at every backward and has no forward times"),
    "test_ddp_logging_data_gpu": Reason(
        "internal", "reads `forward_compute_time`, `device_ids` and DDP's sampling of runtime "
        f"figures from its log ({_LOGGING})"),
    "test_ddp_python_error_logged": Reason(
        "internal", "expects the log fields `has_error` and `error` (DDP logs its errors; "
        "tribucket raises them)"),
    "test_static_graph_api_cpu": Reason(
        "internal", "after the same `RuntimeError`, expects the log fields `has_error` and "
        "`error`"),
    "test_invalid_static_graph": Reason(
        "internal", "expects DDP's message \"Your training graph has changed in this "
        "iteration\"; tribucket raises a `RuntimeError` too, naming the parameter whose "
        "gradient count changed"),
    "test_ddp_multiple_nested_unused_params_error": Reason(
        "documented", "a backward leaves parameters without gradients (no "
        "`find_unused_parameters`): tribucket raises at the end of that backward, on every "
        "rank, naming the parameters; DDP raises at the next forward, and the test expects that "
        "timing and DDP's message (\"did not receive grad\", parameter indices) "
        f"({_MISSING})"),
    "test_ddp_multiple_nested_unused_params_err_ignore_params": Reason(
        "documented", "as `test_ddp_multiple_nested_unused_params_error`, with ignored "
        f"parameters ({_MISSING})"),
    "test_ddp_unused_params_rebuild_buckets_exception": Reason(
        "documented", "as `test_ddp_multiple_nested_unused_params_error`: tribucket raises at "
        "the end of the backward that left `net2.weight` without a gradient; the test expects "
        f"DDP's message at the next forward and the log field `has_error` ({_MISSING})"),
    "test_ddp_profiling_torch_profiler": Reason(
        "internal", "expects the profiler range `search_unused_parameters` that DDP's C++ "
        "reducer records (the collectives' own events are found)"),
    "test_ddp_uneven_inputs": Reason(
        "internal", "reads DDP's private `_authoritative_rank` after `join()`"),
}
