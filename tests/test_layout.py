"""compute_layout: differential against torch's own bucket assignment, and every invariant."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

import tribucket
from tribucket import TensorSpec, compute_layout
from tribucket.layout import BucketLayout, _unordered_map_order
from tribucket.testing import (LayoutInvariantError, check_layout, layouts, tensor_spec_lists)


def _materialize(specs):
    return [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in specs]


def _torch_assignment(tensors, cap, first, sparse, order, cap_list=None):
    """What torch DDP computes, in the order DDP reduces the buckets (``cap_list``: DDP's
    ``bucket_cap_mb_list`` in bytes, its caps in place of ``first`` and ``cap``)."""
    if not tensors:
        return []  # torch's function asserts on an empty list
    limits = list(cap_list) if cap_list else [cap if first is None else first, cap]
    sparse = [False] * len(tensors) if sparse is None else list(sparse)
    if order is None:
        groups, _ = dist._compute_bucket_assignment_by_size(tensors, limits, sparse)
        return list(reversed(groups))  # DistributedDataParallel reverses the list
    in_order = [tensors[i] for i in order]
    groups, _ = dist._compute_bucket_assignment_by_size(in_order, limits, sparse, list(order))
    return groups


@given(layouts())
def test_grouping_equals_torch(case):
    kw = case.kwargs
    expected = _torch_assignment(_materialize(case.tensors), kw["bucket_cap_bytes"],
                                 kw["first_bucket_cap_bytes"], kw["expect_sparse"], kw["order"],
                                 kw.get("bucket_cap_bytes_list"))
    assert case.layout.bucket_indices() == expected


@settings(max_examples=200)
@given(tensor_spec_lists(max_size=30), st.lists(st.integers(1, 8192), min_size=1, max_size=5),
       st.data())
def test_cap_lists_equal_torch(specs, caps, data):
    """One cap per bucket, the last repeating (DDP's ``bucket_cap_mb_list``), in definition
    order and in a ready order: torch's buckets, and every invariant."""
    n = len(specs)
    order = data.draw(st.one_of(st.none(), st.permutations(range(n))))
    kwargs = dict(bucket_cap_bytes_list=caps, order=order, align_bytes=16)
    layout = compute_layout(specs, **kwargs)
    assert layout.bucket_indices() == _torch_assignment(_materialize(specs), None, None, None,
                                                        order, caps)
    check_layout(layout, specs, **kwargs)


def test_cap_list_is_checked():
    ts = [TensorSpec((4,))]
    for bad in ([], [0], [16, -1], [1.5], (True,)):
        with pytest.raises(ValueError, match="bucket_cap_bytes_list"):
            compute_layout(ts, bucket_cap_bytes_list=bad)


@given(layouts())
def test_layout_invariants(case):
    check_layout(case.layout, case.tensors, **case.kwargs)


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from([torch.float32, torch.float16, torch.bfloat16,
                                            torch.float64, torch.int64, torch.int32,
                                            torch.uint8, torch.bool, torch.complex64,
                                            torch.int8, torch.int16, torch.float8_e5m2,
                                            torch.float8_e4m3fn, torch.float8_e5m2fnuz,
                                            torch.float8_e4m3fnuz, torch.uint16,
                                            torch.uint32, torch.uint64]),
                          st.sampled_from(["cpu", "meta"])),
                min_size=1, max_size=22, unique=True))
def test_unordered_map_emulation_matches_torch(keys):
    """The partly-filled buckets of a rebuild come out in the C++ hash map's order."""
    tensors = [torch.empty(1, dtype=d, device=v) for d, v in keys]
    groups, _ = dist._compute_bucket_assignment_by_size(tensors, [1 << 40], [False] * len(keys),
                                                        list(range(len(keys))))
    expected = [keys[g[0]] for g in groups]
    got = _unordered_map_order([(d, torch.device(v)) for d, v in keys])
    assert [(d, torch.device(v)) for d, v in expected] == got


def test_docstring_example():
    layout = compute_layout([torch.empty(3), torch.empty(5)], bucket_cap_bytes=1 << 20)
    b = layout.buckets[0]
    assert (b.indices, b.offsets, b.numel, b.padding) == ((0, 1), (0, 4), 9, 1)
    assert layout.locate(1) == (0, 4)


def test_default_caps_first_bucket_is_small():
    # 10 x 512 KiB fp32 tensors: the last two (the first ready) fill the 1 MiB first bucket
    ts = [TensorSpec((128 * 1024,)) for _ in range(10)]
    layout = compute_layout(ts)
    expected = list(reversed(dist._compute_bucket_assignment_by_size(
        _materialize(ts), [2**20, 25 * 2**20])[0]))
    assert layout.bucket_indices() == expected


def test_tensor_larger_than_cap_gets_own_bucket():
    ts = [TensorSpec((1000,)), TensorSpec((10,)), TensorSpec((10,))]
    layout = compute_layout(ts, bucket_cap_bytes=100, first_bucket_cap_bytes=None)
    # tensor 0 alone overshoots the 100-byte cap; the two small ones share the partial bucket
    assert [b.indices for b in layout.buckets] == [(1, 2), (0,)]
    assert layout.buckets[1].payload_bytes == 4000 > layout.buckets[1].cap_bytes
    check_layout(layout, ts, bucket_cap_bytes=100, first_bucket_cap_bytes=None)


def test_mixed_dtype_rebuild_matches_torch():
    ts = [torch.empty(100), torch.empty(100, dtype=torch.bfloat16), torch.empty(300),
          torch.empty(7, dtype=torch.bfloat16), torch.empty(50, dtype=torch.float64)]
    order = [4, 3, 2, 1, 0]
    layout = compute_layout(ts, bucket_cap_bytes=1000, first_bucket_cap_bytes=200, order=order)
    assert layout.bucket_indices() == _torch_assignment(ts, 1000, 200, None, order)


def test_encoding_round_trip_and_mismatch():
    ts = [TensorSpec((4, 4)), TensorSpec((3,), torch.float16), TensorSpec((0,))]
    layout = compute_layout(ts, bucket_cap_bytes=32, order=[2, 0, 1])
    enc = layout.to_tensor()
    assert enc.dtype == torch.int64
    assert BucketLayout.from_tensor(enc, ts).buckets == layout.buckets
    with pytest.raises(ValueError, match="encoded layout is for 3 tensors but 2"):
        BucketLayout.from_tensor(enc, ts[:2])


@pytest.mark.parametrize("kwargs, match", [
    (dict(bucket_cap_bytes=0), r"bucket_cap_bytes must be a positive int .* got 0"),
    (dict(bucket_cap_bytes=-5), r"bucket_cap_bytes must be a positive int .* got -5"),
    (dict(first_bucket_cap_bytes=0), r"first_bucket_cap_bytes must be a positive int"),
    (dict(bucket_cap_bytes=1.5), r"bucket_cap_bytes must be a positive int .* got 1.5"),
    (dict(order=[0, 0]), r"order must be a permutation of range\(2\)"),
    (dict(order=[0]), r"order must be a permutation of range\(2\)"),
    (dict(expect_sparse=[True]), r"expect_sparse has 1 entries but there are 2 tensors"),
    (dict(align_bytes=3), r"align_bytes must be a positive power of two, got 3"),
])
def test_bad_input_names_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_layout([torch.empty(2), torch.empty(3)], **kwargs)


def test_non_tensor_rejected():
    with pytest.raises(ValueError, match=r"tensors\[1\] is a list"):
        compute_layout([torch.empty(2), [1, 2]])


def test_check_layout_reports_violation_in_words():
    ts = [TensorSpec((10,)), TensorSpec((10,))]
    good = compute_layout(ts, bucket_cap_bytes=1 << 20)
    bad_bucket = tribucket.Bucket((0, 1), (0, 8), (10, 10), 20, torch.float32,
                                  torch.device("cpu"), 1 << 20)
    bad = BucketLayout((bad_bucket,), 2, 16)
    check_layout(good, ts, bucket_cap_bytes=1 << 20)
    with pytest.raises(LayoutInvariantError, match="overlaps the previous tensor"):
        check_layout(bad, ts, bucket_cap_bytes=1 << 20)
    missing = BucketLayout((tribucket.Bucket((0,), (0,), (10,), 10, torch.float32,
                                             torch.device("cpu"), 1 << 20),), 2, 16)
    with pytest.raises(LayoutInvariantError, match="tensor 1 is in 0 buckets"):
        check_layout(missing, ts, bucket_cap_bytes=1 << 20)


@given(tensor_spec_lists(max_size=10), st.integers(1, 4096))
def test_model_style_property(specs, cap):
    """The recipe of docs/layouts.md for users: property-test the layouts of your own tensors."""
    layout = compute_layout(specs, bucket_cap_bytes=cap)
    check_layout(layout, specs, bucket_cap_bytes=cap)


def _run_blocked(module: str, code: str) -> subprocess.CompletedProcess:
    prog = f"import sys; sys.modules[{module!r}] = None\n{code}"
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                          timeout=120)


def test_import_without_triton_and_hypothesis():
    r = _run_blocked("triton", "import sys; sys.modules['hypothesis'] = None\n"
                               "import tribucket, tribucket.kernels; print('ok')")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_testing_without_hypothesis_names_the_extra():
    r = _run_blocked("hypothesis", "import tribucket.testing")
    assert r.returncode != 0
    assert "pip install 'tribucket[testing]'" in r.stderr


@pytest.mark.parametrize("argv", [["--bucket-cap-mb", "0"], ["--bucket-cap-mb", "nan"],
                                  ["--bucket-cap-mb", "inf"], ["--first-bucket-cap-mb", "-1"]])
def test_report_cli_refuses_caps_that_are_not_positive_sizes(capsys, argv):
    from tribucket import report

    with pytest.raises(SystemExit) as exc:
        report.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and argv[1] in err, err


def test_report_cli_calls_only_ddps_caps_its_defaults(capsys):
    from tribucket import report

    report.main(["--model", "mlp"])
    assert "(DDP's defaults)" in capsys.readouterr().out
    report.main(["--model", "mlp", "--bucket-cap-mb", "5"])
    assert "DDP's defaults" not in capsys.readouterr().out
