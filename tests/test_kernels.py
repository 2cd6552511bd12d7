"""kernels.pack / kernels.unpack: the Triton kernels (under the interpreter on CPU, natively
on CUDA) and the torch path, each against the plain-PyTorch references."""

import doctest
import importlib

import pytest
import torch
from hypothesis import Phase, given, settings, strategies as st

from tribucket import kernels
from tribucket.kernels import pack_reference, unpack_reference

P = importlib.import_module("tribucket.kernels.pack")  # the module (kernels.pack is the function)

# the interpreter runs kernels in numpy, which warns about the inf/NaN the tests feed it
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on a busy 2-core box, OpenMP threads that wait for a descheduled
    sibling made these tests 10x slower; the inputs are too small to gain from two."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
PAIRS = [(s, d) for s in FLOATS for d in FLOATS]
SCALES = (1.0, 0.5, 1 / 3, 1 / 7, 1e-3, 3.0, 1024.0, 65536.0)
CHUNK = P._CPU_CHUNK
# Shrinking a failure under the interpreter takes minutes (past the suite's timeout): report
# the first failing example as found.
INTERPRETER_PHASES = [Phase.explicit, Phase.reuse, Phase.generate]


def _triton_device(name):
    """A pytest param for running the Triton kernels on `name`, skipped (never faked)."""
    if name == "cuda":
        return pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
            not HAS_CUDA, reason="no CUDA device")])
    reason = ("triton is not installed" if not kernels.triton_available() else
              "kernels were not defined under the Triton interpreter (TRITON_INTERPRET=1 "
              "is set by conftest.py only on machines without a GPU)")
    return pytest.param("cpu", marks=[pytest.mark.interpreter, pytest.mark.skipif(
        not P._interpreting_kernels(), reason=reason)])


TRITON = [_triton_device("cpu"), _triton_device("cuda")]
TORCH = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device")])]


def _with_backend(backend, params):
    out = []
    for p in params:
        p = p if hasattr(p, "values") else pytest.param(p)
        out.append(pytest.param(backend, *p.values, marks=p.marks, id=f"{backend}-{p.values[0]}"))
    return out


BACKENDS = _with_backend("triton", TRITON) + _with_backend("torch", TORCH)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


# -- helpers ------------------------------------------------------------------------------
def bits(t):
    """The raw bits of t, flattened (complex128: two int64 per element)."""
    return t.reshape(-1).view(_BITS[t.element_size()])


def assert_bitwise(actual, expected, what=""):
    """Same shape, dtype and bits (NaN payloads included)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = bits(actual.cpu()), bits(expected.cpu())
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.numel()} elements differ, first at {bad[0].item()}: "
                              f"{actual.reshape(-1)[bad[0]].item()} != "
                              f"{expected.reshape(-1)[bad[0]].item()}")


def assert_values(actual, expected, what=""):
    """Same shape, dtype, NaN positions, and bits everywhere else (torch's own casts give
    NaNs different payloads on different code paths)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.cpu().reshape(-1), expected.cpu().reshape(-1)
    an, en = a.isnan(), e.isnan()
    assert torch.equal(an, en), f"{what}: NaN at different positions"
    assert_bitwise(a[~an], e[~en], what)


def values(n, dtype, gen, specials):
    """Values that exercise every rounding case: 2**-30 .. 2**20 (fp16 subnormals and
    overflow), exact bf16/fp16 ties, and, with `specials`, inf/-inf/NaN."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 21, (n,), generator=gen).float())
    ib = x.view(torch.int32)
    kind = torch.randint(0, 64, (n,), generator=gen)
    ib = torch.where(kind < 16, (ib & ~0xFFFF) | 0x8000, ib)                 # bf16 half-way
    ib = torch.where((kind >= 16) & (kind < 32), (ib & ~0x1FFF) | 0x1000, ib)  # fp16 half-way
    x = ib.view(torch.float32)
    if specials:
        x = torch.where(kind == 32, float("inf"), x)
        x = torch.where(kind == 33, float("-inf"), x)
        x = torch.where(kind == 34, float("nan"), x)
    return x.to(dtype)


@st.composite
def bucket_layouts(draw, max_tensors=50, sizes=st.integers(0, 5000), max_total=None):
    """(sizes, offsets, numel): alignment gaps, a leading gap and a tail; with
    ``max_total``, sizes past that many elements in all are clipped."""
    n = draw(st.integers(0, max_tensors))
    sz = draw(st.lists(sizes, min_size=n, max_size=n))
    if max_total is not None:
        room = [max_total - sum(sz[:i]) for i in range(n)]
        sz = [max(0, min(s, r)) for s, r in zip(sz, room)]
    align = draw(st.sampled_from([1, 2, 4, 8]))
    o = draw(st.integers(0, 5))
    offsets = []
    for s in sz:
        o = -(-o // align) * align + draw(st.sampled_from([0, 0, 0, 1, 7]))
        offsets.append(o)
        o += s
    return sz, offsets, o + draw(st.integers(0, 3))


def sentinel(numel, dtype, device):
    """A buffer full of a recognisable value, so writes into the gaps show."""
    return torch.full((numel,), -3.0 if dtype.is_floating_point else 3, dtype=dtype, device=device)


# -- the Triton kernels and the torch path vs the references -------------------------------
def check_pack(backend, device, layout, pair, scale, specials, check_inf, seed, nones=0,
               check=True):
    sizes, offsets, numel = layout
    src_dtype, out_dtype = pair
    gen = torch.Generator().manual_seed(seed)
    ts = [values(n, src_dtype, gen, specials).to(device) for n in sizes]
    if ts and nones:  # None entries: their slices are zero-filled
        for i in torch.randint(0, len(ts), (nones,), generator=gen).tolist():
            ts[i] = None
    ref_ts = [torch.zeros(n, dtype=src_dtype, device=device) if t is None else t
              for t, n in zip(ts, sizes)]
    out, expected = sentinel(numel, out_dtype, device), sentinel(numel, out_dtype, device)
    flag = torch.zeros(1, device=device) if check_inf else None
    flag_ref = torch.zeros(1, device=device) if check_inf else None
    plan = kernels.BucketPlan(sizes, offsets, numel, device, backend=backend)
    for _ in range(2):  # the second call runs on cached tables and views
        assert plan.pack(ts, out, scale=scale, found_inf=flag, check=check) is out
    pack_reference(ref_ts, expected, offsets, scale=scale, found_inf=flag_ref)
    what = f"{src_dtype}->{out_dtype} scale={scale}"
    if src_dtype == out_dtype and scale == 1.0:
        assert_bitwise(out, expected, what)
    else:
        assert_values(out, expected, what)
    if check_inf:
        assert flag.item() == flag_ref.item(), f"{what}: found_inf {flag.item()} != {flag_ref.item()}"


def check_unpack(backend, device, layout, pair, scale, accumulate, seed, nones=0, check=True):
    sizes, offsets, numel = layout
    buf_dtype, t_dtype = pair
    gen = torch.Generator().manual_seed(seed)
    buffer = values(numel, buf_dtype, gen, True).to(device)
    ts = [values(n, t_dtype, gen, False).to(device) for n in sizes]
    expected = [t.clone() for t in ts]
    if ts and nones:  # None entries are skipped
        for i in torch.randint(0, len(ts), (nones,), generator=gen).tolist():
            ts[i] = expected[i] = None
    plan = kernels.BucketPlan(sizes, offsets, numel, device, backend=backend)
    plan.unpack(buffer, ts, scale=scale, accumulate=accumulate, check=check)
    unpack_reference(buffer, expected, offsets, scale=scale, accumulate=accumulate)
    for i, (a, e) in enumerate(zip(ts, expected)):
        if a is not None:
            assert_values(a, e, f"tensor {i}: {buf_dtype}->{t_dtype} scale={scale} acc={accumulate}")


@pytest.mark.parametrize("device", TRITON)
@settings(max_examples=12, phases=INTERPRETER_PHASES)
@given(layout=bucket_layouts(), pair=st.sampled_from(PAIRS), scale=st.sampled_from(SCALES),
       specials=st.booleans(), check_inf=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_triton_pack_matches_reference(device, layout, pair, scale, specials, check_inf, seed):
    check_pack("triton", device, layout, pair, scale, specials, check_inf, seed)


@pytest.mark.parametrize("device", TRITON)
@settings(max_examples=12, phases=INTERPRETER_PHASES)
@given(layout=bucket_layouts(), pair=st.sampled_from(PAIRS), scale=st.sampled_from(SCALES),
       accumulate=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_triton_unpack_matches_reference(device, layout, pair, scale, accumulate, seed):
    check_unpack("triton", device, layout, pair, scale, accumulate, seed)


@pytest.mark.parametrize("device", TRITON)
def test_triton_edge_layouts(device):
    """Empty bucket, empty tensors only, one tensor over several blocks, many tiny tensors."""
    cases = [([], [], 0), ([0, 0], [0, 0], 4), ([2 * P.BLOCK + 17], [5], 2 * P.BLOCK + 30),
             ([1, 3] * 150, [4 * i for i in range(300)], 1200)]
    for sizes, offsets, numel in cases:
        gen = torch.Generator().manual_seed(len(sizes))
        ts = [values(n, torch.float32, gen, False).to(device) for n in sizes]
        out, expected = sentinel(numel, torch.float16, device), sentinel(numel, torch.float16, device)
        plan = kernels.BucketPlan(sizes, offsets, numel, device, backend="triton")
        plan.pack(ts, out, scale=0.5)
        pack_reference(ts, expected, offsets, scale=0.5)
        assert_values(out, expected, f"{len(sizes)} tensors")
        back = [torch.zeros_like(t) for t in ts]
        plan.unpack(out, back, scale=2.0)
        unpack_reference(out, ts, offsets, scale=2.0)
        for a, e in zip(back, ts):
            assert_values(a, e, "unpack")


class _AlignSpy:
    """Wraps a kernel so every launch records the ``ALIGN`` it was given, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.aligns = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.aligns.append(kwargs["ALIGN"])
            return self.kernel[grid](*args, **kwargs)
        return launch


def _aligned_case(src_dtype, dst_dtype, device, *, odd_size=False, shift_src=False,
                  shift_buf=False):
    """Tensors of 16-byte multiples at 16-byte offsets, optionally broken in one place."""
    sizes = [P.BLOCK + 16, 8, 0, 24 + (1 if odd_size else 0), 16]
    offsets, o = [], 16
    for n in sizes:
        offsets.append(o)
        o += -(-n // 16) * 16
    gen = torch.Generator().manual_seed(7)
    ts = [values(n + 1, src_dtype, gen, False).to(device) for n in sizes]
    ts = [t[1:] if shift_src and i == 3 else t[:-1] for i, t in enumerate(ts)]  # 1 element off
    ts[1] = None  # a zero-filled slice: pointer 0 is aligned
    buf = sentinel(o + 1, dst_dtype, device)
    buf = buf[1:] if shift_buf else buf[:-1]
    return sizes, offsets, ts, buf


@pytest.mark.parametrize("device", TRITON)
@pytest.mark.parametrize("pair", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                  (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
                                  (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("broken", [None, "odd_size", "shift_src", "shift_buf"])
def test_triton_aligned_and_scalar_paths(device, pair, broken, monkeypatch):
    """The host check picks the 128-bit kernel (ALIGN = 16 bytes in elements of the narrower
    dtype) only when every address, offset and size allows it, and both kernels equal the
    reference (pack with scale 1 and 0.5 and found_inf, unpack with accumulate)."""
    src_dtype, dst_dtype = pair
    sizes, offsets, ts, out = _aligned_case(src_dtype, dst_dtype, device, **(
        {broken: True} if broken else {}))
    ref_ts = [torch.zeros(n, dtype=src_dtype, device=device) if t is None else t
              for t, n in zip(ts, sizes)]
    plan = kernels.BucketPlan(sizes, offsets, out.numel(), device, backend="triton")
    T = importlib.import_module("tribucket.kernels.pack_triton")
    pack_spy, unpack_spy = _AlignSpy(T._pack_kernel), _AlignSpy(T._unpack_kernel)
    monkeypatch.setattr(T, "_pack_kernel", pack_spy)
    monkeypatch.setattr(T, "_unpack_kernel", unpack_spy)
    for scale in (1.0, 0.5):
        flag, flag_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
        expected = out.clone()
        plan.pack(ts, out, scale=scale, found_inf=flag)
        pack_reference(ref_ts, expected, offsets, scale=scale, found_inf=flag_ref)
        assert_values(out, expected, f"pack {pair} scale={scale} broken={broken}")
        assert flag.item() == flag_ref.item()
        back = [None if t is None else torch.ones_like(t) for t in ts]
        if broken == "shift_src":  # the unpack destination is the one off by an element
            back[3] = torch.ones(sizes[3] + 1, dtype=src_dtype, device=device)[1:]
        want = [None if t is None else torch.ones_like(t) for t in ts]
        plan.unpack(out, back, scale=2.0, accumulate=scale != 1.0)
        unpack_reference(out, want, offsets, scale=2.0, accumulate=scale != 1.0)
        for i, (a, e) in enumerate(zip(back, want)):
            if a is not None:
                assert_values(a, e, f"unpack tensor {i} {pair} broken={broken}")
    vec = 16 // min(src_dtype.itemsize, dst_dtype.itemsize)
    want_align = vec if broken is None else 1
    assert pack_spy.aligns == [want_align] * 2, f"pack ALIGN {pack_spy.aligns}, want {want_align}"
    assert unpack_spy.aligns == [want_align] * 2, \
        f"unpack ALIGN {unpack_spy.aligns}, want {want_align}"


def _cast_cases():
    x = torch.tensor([1.00390625, 1.01171875, -1.00390625, 1 + 2**-11, 1 + 3 * 2**-11,
                      65504.0, 65519.99, 65520.0, 6e-8, 2**-25, 3e-8, 1e-45, -0.0,
                      3.3961775e38, 3.4e38, float("inf"), float("-inf"), float("nan")])
    # NaNs whose payload would round into the exponent (to inf, or wrap past 0xFFFFFFFF)
    nans = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, -0x007FFFFF, 0x7F808000],
                        dtype=torch.int32).view(torch.float32)
    return torch.cat([x, nans])


@pytest.mark.parametrize("device", TRITON)
@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16])
def test_triton_cast_rounds_to_nearest_even(device, dst):
    """Ties, the overflow thresholds, subnormals and specials, against Tensor.to."""
    x = _cast_cases().to(device)
    out = torch.zeros(len(x), dtype=dst, device=device)
    kernels.BucketPlan([len(x)], [0], len(x), device, backend="triton").pack([x], out)
    assert_values(out, x.to(dst), f"fp32->{dst}")


def _bit_copy_tensors(dtype, gen, n):
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(n, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        # random bit patterns: NaN payloads, signalling NaNs, subnormals
        b = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int64)
        return b.to(_BITS[torch.empty(0, dtype=dtype).element_size()]).view(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)


COPY_DTYPES = [torch.int64, torch.float64, torch.bool, torch.int8, torch.uint8, torch.int32,
               torch.int16, torch.complex64, torch.complex128, torch.float32, torch.float16,
               torch.bfloat16]


@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=str)
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_copy_is_bit_exact_for_any_dtype(backend, device, dtype):
    sizes, offsets, numel = [5, 0, 4099, 1], [1, 6, 8, 4110], 4113
    gen = torch.Generator().manual_seed(1)
    ts = [_bit_copy_tensors(dtype, gen, n).to(device) for n in sizes]
    plan = kernels.BucketPlan(sizes, offsets, numel, device, backend=backend)
    out = torch.zeros(numel, dtype=dtype, device=device)
    expected = out.clone()
    plan.pack(ts, out)
    pack_reference(ts, expected, offsets)
    assert_bitwise(out, expected, f"pack {dtype}")
    back = [torch.zeros_like(t) for t in ts]
    plan.unpack(out, back)
    for a, e in zip(back, ts):
        assert_bitwise(a, e, f"unpack {dtype}")


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_found_inf(backend, device):
    big = 300000 if backend == "torch" else 5000  # torch: several L2 pieces; Triton: 2 blocks
    sizes, offsets, numel = [3, big, 7], [0, 4, big + 8], big + 16
    plan = kernels.BucketPlan(sizes, offsets, numel, device, backend=backend)

    def run(ts, dtype, scale=1.0, start=0.0):
        flag = torch.full((1,), start, device=device)
        plan.pack([t.to(device) for t in ts], torch.zeros(numel, dtype=dtype, device=device),
                   scale=scale, found_inf=flag)
        return flag.item()

    large = [torch.full((n,), 60000.0) for n in sizes]  # finite, but their sums overflow fp16
    assert run(large, torch.float16) == 0.0, "finite values whose sum overflows are not inf"
    assert run(large, torch.float16, start=1.0) == 1.0, "found_inf is never cleared"
    assert run(large, torch.float16, scale=2.0) == 1.0, "fp16 overflow after the scale"
    assert run(large, torch.float32, scale=2.0) == 0.0
    for special in (float("inf"), float("-inf"), float("nan")):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            ts = [torch.ones(n) for n in sizes]
            ts[1][big // 2 + 1] = special
            assert run(ts, dtype) == 1.0, f"{special} in a {dtype} copy"
            assert run(ts, dtype, scale=0.5) == 1.0, f"{special} scaled into {dtype}"
    assert run([torch.full((n,), 3e38) for n in sizes], torch.float32, scale=10.0) == 1.0


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_accumulate_rounds_the_product_first(backend, device):
    """t + fl(x * s), not a fused multiply-add: the data is chosen so the two differ."""
    gen = torch.Generator().manual_seed(0)
    x, t = torch.randn(4099, generator=gen), torch.randn(4099, generator=gen)
    s = 1 / 3
    fused = (t.double() + x.double() * torch.tensor(s).float().double()).float()
    expected = t + x * s
    assert not torch.equal(fused, expected), "the data must tell the two roundings apart"
    plan = kernels.BucketPlan([4099], [1], 4100, device, backend=backend)
    got = t.clone().to(device)
    plan.unpack(torch.cat([torch.zeros(1), x]).to(device), [got], scale=s, accumulate=True)
    assert_bitwise(got, expected.to(device), "accumulate")


# -- int64 index math ----------------------------------------------------------------------
@pytest.mark.parametrize("device", TRITON)
def test_index_math_is_int64(device):
    """A fake tensor of 2**31 + 2**20 + 3 + n elements whose last n live in a real tensor:
    the kernels must index past 2**31 without wrapping (on a two-row table)."""
    huge = 2**31 + 2**20 + 3
    n = P.BLOCK + 904
    src = torch.randn(n, device=device)
    out = torch.zeros(n + 8, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    sizes = torch.tensor([huge + n], **i64)
    offsets = torch.tensor([3 - huge], **i64)  # virtual element `huge` lands at out[3]
    block_tensor = torch.zeros(2, dtype=torch.int32, device=device)
    block_start = torch.tensor([huge, huge + P.BLOCK], **i64)
    ptrs = torch.tensor([src.data_ptr() - huge * 4], **i64)  # virtual element `huge` = src[0]
    P._pack_kernel[(2,)](ptrs, sizes, offsets, block_tensor, block_start, out, sizes, 1.0,
                         SRC=P.tl.float32, DST=P.tl.float32, COPY=True, CHECK=False,
                         BLOCK=P.BLOCK, ALIGN=1)  # the layout is not 16-byte aligned
    assert torch.equal(out[3:3 + n], src) and not out[:3].any() and not out[3 + n:].any()
    back = torch.zeros(n, device=device)
    ptrs = torch.tensor([back.data_ptr() - huge * 4], **i64)
    P._unpack_kernel[(2,)](ptrs, sizes, offsets, block_tensor, block_start, out, 2.0,
                           DST=P.tl.float32, COPY=False, ACCUMULATE=False, BLOCK=P.BLOCK,
                           ALIGN=1)
    assert torch.equal(back, src * 2)


def test_block_map_is_int64_past_2_31_elements():
    bt, bs = P._block_map([3, 2**33 + 5, 1], P.BLOCK)
    nb = -(-(2**33 + 5) // P.BLOCK)
    assert bt.dtype == torch.int32 and bs.dtype == torch.int64
    assert len(bt) == nb + 2
    assert bt[0].item() == 0 and bs[0].item() == 0
    assert bt[-2].item() == 1 and bs[-2].item() == (nb - 1) * P.BLOCK == 2**33
    assert bt[-1].item() == 2 and bs[-1].item() == 0


# -- the torch path (what CPU tensors get) ---------------------------------------------
BIG_SIZES = st.one_of(st.integers(0, 5000), st.integers(5000, 200000),
                      st.sampled_from([CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]))
ALL_PAIRS = PAIRS + [(torch.float64, torch.float32), (torch.float32, torch.float64),
                     (torch.float64, torch.float64), (torch.float16, torch.float64)]


@pytest.mark.parametrize("device", TORCH)
@settings(max_examples=60)
@given(layout=bucket_layouts(max_tensors=30, sizes=BIG_SIZES, max_total=10**6), pair=st.sampled_from(ALL_PAIRS),
       scale=st.sampled_from(SCALES), specials=st.booleans(), check_inf=st.booleans(),
       nones=st.integers(0, 3), check=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_torch_pack_matches_reference(device, layout, pair, scale, specials, check_inf,
                                      nones, check, seed):
    check_pack("torch", device, layout, pair, scale, specials, check_inf, seed, nones, check)


@pytest.mark.parametrize("device", TORCH)
@settings(max_examples=60)
@given(layout=bucket_layouts(max_tensors=30, sizes=BIG_SIZES, max_total=10**6), pair=st.sampled_from(ALL_PAIRS),
       scale=st.sampled_from(SCALES), accumulate=st.booleans(), nones=st.integers(0, 3),
       check=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_torch_unpack_matches_reference(device, layout, pair, scale, accumulate, nones,
                                        check, seed):
    check_unpack("torch", device, layout, pair, scale, accumulate, seed, nones, check)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_many_shapes_none_mixed_dtypes_and_caches(backend, device):
    """0-dim and n-d tensors, None entries, mixed source dtypes in one call, new data at
    new addresses, a second buffer and changed shapes: every call still equals the reference."""
    shapes = [(), (3, 5), (7,), (2, 2, 2), (1,), (4099,)]
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    offsets, o = [], 1
    for n in sizes:
        offsets.append(o)
        o += n + 3
    plan = kernels.BucketPlan(sizes, offsets, o, device, backend=backend)
    gen = torch.Generator().manual_seed(0)
    for step, dtypes in enumerate([[torch.float32] * 6, [torch.float32] * 6,
                                   [torch.float16, torch.float32, torch.bfloat16] * 2]):
        ts = [values(n, d, gen, False).reshape(s).to(device)
              for n, s, d in zip(sizes, shapes, dtypes)]
        if step == 1:
            ts[2] = None
        ref_ts = [torch.zeros(n, device=device) if t is None else t for t, n in zip(ts, sizes)]
        for out_dtype in (torch.float32, torch.bfloat16):
            out, expected = sentinel(o, out_dtype, device), sentinel(o, out_dtype, device)
            plan.pack(ts, out, scale=0.25)
            pack_reference(ref_ts, expected, offsets, scale=0.25)
            assert_values(out, expected, f"step {step} pack -> {out_dtype}")
            back = [None if t is None else torch.zeros_like(t) for t in ts]
            plan.unpack(out, back, scale=4.0)
            want = [None if t is None else torch.zeros_like(t) for t in ts]
            unpack_reference(out, want, offsets, scale=4.0)
            for a, e in zip(back, want):
                if a is not None:
                    assert_values(a, e, f"step {step} unpack")
    # the same layout with other shapes (equal sizes): the cached views must follow
    flat = [torch.ones(n, device=device) for n in sizes]
    out = torch.arange(o, dtype=torch.float32, device=device)
    plan.unpack(out, flat)
    for t, off in zip(flat, offsets):
        assert torch.equal(t, out[off:off + t.numel()])


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_sources_that_are_views_of_their_own_slot(backend, device):
    """Gradients that already live in the bucket (gradient_as_bucket_view) pack in place."""
    sizes, offsets, numel = [4, 6, 3, 5], [0, 4, 12, 15], 20
    plan = kernels.BucketPlan(sizes, offsets, numel, device, backend=backend)
    for scale in (1.0, 0.5):
        out = torch.arange(numel, dtype=torch.float32, device=device)
        ts = [out[0:4].view(2, 2), out[4:10], torch.full((3,), 7.0, device=device),
              out[15:20]]
        expected = torch.arange(numel, dtype=torch.float32, device=device)
        pack_reference([t.clone() for t in ts], expected, offsets, scale=scale)
        plan.pack(ts, out, scale=scale)
        assert_bitwise(out, expected, f"scale {scale}")


def test_forget_releases_the_cached_views():
    """The plan's cached views reference the buffer's storage until forget(buf)."""
    def use_count(t):
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    plan = kernels.BucketPlan([3, 5], [0, 4], 9, "cpu", backend="torch")
    buf, other = torch.zeros(9), torch.zeros(9)
    base = use_count(buf)
    plan.pack([torch.ones(3), torch.ones(5)], buf, scale=0.5)
    plan.unpack(buf, [torch.ones(3), torch.ones(5)])
    plan.pack([torch.ones(3), torch.ones(5)], other)
    assert use_count(buf) > base
    plan.forget(buf)
    assert use_count(buf) == base
    assert len(plan._views) == 1, "views of other buffers are kept"
    plan.pack([torch.ones(3), torch.ones(5)], buf)  # still works after forgetting
    assert torch.equal(buf, torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 1.0]))


@pytest.mark.parametrize("device", TORCH)
def test_thousands_of_tiny_tensors(device):
    sizes = [1 + i % 5 for i in range(5000)]
    offsets, o = [], 0
    for n in sizes:
        offsets.append(o)
        o += n + n % 2  # every other tensor leaves a gap
    gen = torch.Generator().manual_seed(0)
    ts = [values(n, torch.float32, gen, False).to(device) for n in sizes]
    for scale, dtype in [(1.0, torch.float32), (0.5, torch.float32), (0.5, torch.float16)]:
        out, expected = sentinel(o, dtype, device), sentinel(o, dtype, device)
        kernels.pack(ts, out, offsets, scale=scale)
        pack_reference(ts, expected, offsets, scale=scale)
        assert_values(out, expected, f"scale {scale} -> {dtype}")


def test_functional_api_equals_plan():
    gen = torch.Generator().manual_seed(0)
    ts = [values(n, torch.float32, gen, False) for n in (3, 5, 7)]
    offsets = [0, 4, 12]
    out = kernels.pack(ts, torch.zeros(20), offsets, scale=0.5)
    expected = kernels.BucketPlan([3, 5, 7], offsets, 20, "cpu").pack(ts, torch.zeros(20), scale=0.5)
    assert_bitwise(out, expected)
    back = [torch.ones(n) for n in (3, 5, 7)]
    kernels.unpack(out, back, offsets, scale=2.0, accumulate=True)
    for t, b in zip(ts, back):
        assert_bitwise(b, 1 + t)


# -- validation ----------------------------------------------------------------------------
def test_layout_validation():
    with pytest.raises(ValueError, match="overlap"):
        kernels.BucketPlan([4, 4], [0, 2], 8, "cpu")
    with pytest.raises(ValueError, match=r"offsets\[1\] = 6 with 4 elements does not fit"):
        kernels.BucketPlan([4, 4], [0, 6], 8, "cpu")
    with pytest.raises(ValueError, match=r"sizes\[0\] = -1"):
        kernels.BucketPlan([-1], [0], 8, "cpu")
    with pytest.raises(ValueError, match="2 entries but offsets has 1"):
        kernels.BucketPlan([1, 1], [0], 8, "cpu")
    with pytest.raises(TypeError, match="integers"):
        kernels.BucketPlan([1.5], [0], 8, "cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.BucketPlan([1], [0], 1, "cpu", backend="cuda")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(P, "_interpreting_kernels", lambda: False)
    if kernels.triton_available():
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            kernels.BucketPlan([1], [0], 1, "cpu", backend="triton")
    monkeypatch.setattr(P, "triton", None)
    with pytest.raises(ValueError, match=r"needs triton.*tribucket\[triton\]"):
        kernels.BucketPlan([1], [0], 1, "cpu", backend="triton")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not P._interpreting_kernels(), reason="Triton interpreter not active"))])
def test_call_validation(backend):
    plan = kernels.BucketPlan([4, 6], [0, 4], 10, "cpu", backend=backend)
    good = [torch.zeros(4), torch.zeros(2, 3)]
    out = torch.zeros(10)
    cases = [
        (ValueError, r"tensors\[1\] \(shape \(3, 2\), stride \(1, 3\)\) is not dense and contiguous",
         dict(tensors=[good[0], good[1].t()])),
        (ValueError, r"tensors\[0\] has 5 elements", dict(tensors=[torch.zeros(5), good[1]])),
        (ValueError, "got 1 tensors but the layout has 2", dict(tensors=good[:1])),
        (TypeError, r"tensors\[1\] must be a torch.Tensor or None, got list",
         dict(tensors=[good[0], [0.0]])),
        (ValueError, r"tensors\[0\] is on meta", dict(tensors=[torch.zeros(4, device="meta"), good[1]])),
        (ValueError, "out has 11 elements but the layout needs exactly 10",
         dict(out=torch.zeros(11))),
        (ValueError, "out must be a dense contiguous", dict(out=torch.zeros(20)[::2])),
        (TypeError, r"cannot scale or cast torch.int64 -> torch.float32",
         dict(tensors=[torch.zeros(4, dtype=torch.int64), good[1]])),
        (TypeError, r"cannot scale or cast torch.int64 -> torch.int64 \(scale=0.5\)",
         dict(tensors=[torch.zeros(4, dtype=torch.int64)] * 2, out=torch.zeros(10, dtype=torch.int64),
              scale=0.5)),
        (ValueError, "found_inf must be a 1-element float32 tensor",
         dict(found_inf=torch.zeros(1, dtype=torch.float16))),
        (TypeError, "found_inf must be a 1-element float32 tensor or None, got float",
         dict(found_inf=0.0)),
    ]
    for exc, match, kw in cases:
        args = dict(tensors=good, out=out)
        args.update(kw)
        tensors, o = args.pop("tensors"), args.pop("out")
        with pytest.raises(exc, match=match):
            plan.pack(tensors, o, **args)
    with pytest.raises(TypeError, match="accumulate needs floating dtypes"):
        plan.unpack(torch.zeros(10, dtype=torch.int32),
                    [torch.zeros(4, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)],
                    accumulate=True)
    with pytest.raises(ValueError, match="buffer has 9 elements"):
        plan.unpack(torch.zeros(9), good)
    # lazy conjugate and negative views: contiguous, but their values are not their bits
    z = torch.zeros(4, dtype=torch.complex64)
    zplan = kernels.BucketPlan([4], [0], 4, "cpu", backend=backend)
    with pytest.raises(ValueError, match=r"tensors\[0\] is a conjugate view.*resolve_conj"):
        zplan.pack([z.conj()], torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"tensors\[0\] is a conjugate view.*resolve_conj"):
        zplan.unpack(torch.zeros(4, dtype=torch.complex64), [z.conj()])
    with pytest.raises(ValueError, match=r"tensors\[1\] is a negative view.*resolve_neg"):
        plan.pack([good[0], torch._neg_view(good[1])], out)


def test_functional_validation():
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a torch.Tensor, got NoneType"):
        kernels.pack([torch.zeros(1), None], torch.zeros(4), [0, 2])
    with pytest.raises(ValueError, match="got 2 tensors but 1 offsets"):
        kernels.pack([torch.zeros(1), torch.zeros(1)], torch.zeros(4), [0])
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        kernels.pack([torch.zeros(1)], [0.0], [0])
    with pytest.raises(TypeError, match="offsets must be integers"):
        kernels.unpack(torch.zeros(4), [torch.zeros(1)], [0.5])


def test_docstring_examples():
    for mod in (P, importlib.import_module("tribucket.kernels.reference")):
        result = doctest.testmod(mod, extraglobs={"torch": torch})
        assert result.attempted > 0 and result.failed == 0, mod.__name__


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_torch_pack_copy_with_found_inf_keeps_every_bit(dtype):
    """A same-dtype, unscaled pack is a copy even when it also looks for non-finite values:
    NaN payloads pass through unchanged (hypothesis found an fp16 NaN that came out as
    another NaN when the copy went through the float32 compute path)."""
    nan_bits = {torch.float16: 0x7E01, torch.bfloat16: 0x7FC1, torch.float32: 0x7FC00001}
    int_of = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
    src = torch.arange(1, 55, dtype=torch.float32).to(dtype)
    src.view(int_of[dtype])[52] = nan_bits[dtype]
    out = sentinel(54, dtype, "cpu")
    flag = torch.zeros(1)
    kernels.BucketPlan([0, 0, 54], [0, 0, 0], 54, "cpu", backend="torch").pack(
        [torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype), src], out, found_inf=flag)
    assert torch.equal(out.view(int_of[dtype]), src.view(int_of[dtype])), "bits changed"
    assert flag.item() == 1.0, "the NaN was not flagged"


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not P._interpreting_kernels(), reason="Triton interpreter not active"))])
def test_float64_beside_float32_keeps_each_tensors_arithmetic(backend):
    # a call may mix dtypes: a float32 tensor's product is float32's (DDP's
    # torch.mul(grad, 1/world)) even with a float64 tensor in the same call
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(301, generator=g), torch.randn(7, generator=g, dtype=torch.float64)
    plan = kernels.BucketPlan([301, 7], [0, 304], 311, "cpu", backend=backend)
    out, want = torch.zeros(311), torch.zeros(311)
    plan.pack([a, b], out, scale=1 / 7)
    pack_reference([a, b], want, [0, 304], scale=1 / 7)
    assert torch.equal(out, want)
    assert torch.equal(out[:301], torch.mul(a, 1 / 7))
    dst, ref = [torch.zeros(301), torch.zeros(7, dtype=torch.float64)], \
        [torch.zeros(301), torch.zeros(7, dtype=torch.float64)]
    buf = torch.randn(311, generator=g)
    plan.unpack(buf, dst, scale=1 / 7)
    unpack_reference(buf, ref, [0, 304], scale=1 / 7)
    assert all(torch.equal(x, y) for x, y in zip(dst, ref))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not P._interpreting_kernels(), reason="Triton interpreter not active"))])
def test_stats_count_the_floating_values_alone(backend):
    # the figures of a gradient norm: integer tensors written beside add nothing, on both
    # backends and in the reference
    buf = torch.tensor([3.0, 4.0, 0.0, 0.0], dtype=torch.float32)
    ints = torch.tensor([7, 9], dtype=torch.int32)
    plan = kernels.BucketPlan([2, 2], [0, 2], 4, "cpu", backend=backend)
    dst, ref = [torch.zeros(2), torch.zeros(2)], [torch.zeros(2), torch.zeros(2)]
    stats, want = torch.zeros(2), torch.zeros(2)
    plan.unpack(buf, dst, stats=stats)
    unpack_reference(buf, ref, [0, 2], stats=want)
    assert stats.tolist() == want.tolist() == [25.0, 0.0]
    ibuf = torch.tensor([1, 2, 7, 9], dtype=torch.int32)
    istats, iwant = torch.zeros(2), torch.zeros(2)
    plan.unpack(ibuf, [torch.zeros(2, dtype=torch.int32), ints.clone()], stats=istats)
    unpack_reference(ibuf, [torch.zeros(2, dtype=torch.int32), ints.clone()], [0, 2],
                     stats=iwant)
    assert istats.tolist() == iwant.tolist() == [0.0, 0.0]
