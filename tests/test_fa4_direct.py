"""The fa4 backend's direct calls (fa4_direct.py). Without FA4: a stand-in for its interface (a
public function that checks and derives its arguments, compiles once per key into
``compile_cache`` and calls the compiled function with the call's tensors among its own) shows
that later calls skip the public function and give its results, and that whatever the recording
does not understand leaves the call to the public function. On a GPU with FA4: the fa4 backend's
direct calls give FA4's own bits."""

import collections
import sys
import types
from typing import NamedTuple

import pytest
import torch

import spanattn as sa
from spanattn.backends import fa4, fa4_direct, fa4_flags
from spanattn.backends.fa4_direct import PUBLIC, DirectCall, Record, same_bits


class Aux(NamedTuple):  # FA4 passes its aux tensors in a NamedTuple
    tensors: list
    scalars: tuple | None = None


class Cache:
    def __init__(self):
        self.cache = {}

    def __contains__(self, key):
        return key in self.cache

    def __getitem__(self, key):
        return self.cache[key]

    def __setitem__(self, key, fn):
        self.cache[key] = fn


class FakeFA4:
    """``public(q, k, v, table=, aux=, softmax_scale=, softcap=, return_lse=)``; ``how`` makes it
    do what the recording must not trust."""

    def __init__(self, how="plain"):
        self.how, self.public_calls, self.compiled_calls = how, 0, 0
        self.host = lambda: None  # FA4's _flash_attn_fwd: a function carrying the cache
        self.host.compile_cache = Cache()

    def compiled(self, q, k, v, out, lse, scale, tables, aux, extra, *_):
        self.compiled_calls += 1
        base = q.float() * scale + k.float().mean() + 2 * v.float().mean() + tables[1].sum() + extra
        out.copy_(base)
        if lse is not None:
            lse.copy_(q.float().sum(-1).T + aux.tensors[0].sum())

    def public(self, q, k, v, *, table, aux, softmax_scale, softcap, return_lse):
        self.public_calls += 1
        assert softcap == 0.0
        if self.how == "raises":
            raise ValueError("head_dim must be a multiple of 8")
        q = q.clone() if self.how == "copies q" else q
        key = (q.dtype, q.shape[-1], return_lse)
        if key not in self.host.compile_cache:
            self.host.compile_cache[key] = self.compiled
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0]) if return_lse else None
        # a tensor derived per call from a plan's one (FA4's normalized block-sparse views)
        tables = (table, table[None].expand(2, -1)[1])
        # per call from q itself: a recorded one would be stale
        extra = q.float().mean().reshape(1) if self.how == "stale" else torch.zeros(1)
        args = [q.detach(), k.detach(), v.detach(), out.detach(), lse, softmax_scale, tables, Aux(aux), extra]
        if self.how == "two calls":
            self.host.compile_cache[key](*args)
        if self.how == "object":
            args.append(self)  # something whose insides cannot be seen
        if self.how == "nested q":
            args[6] = (table, q)
        if self.how == "keywords":
            self.host.compile_cache[key](*args[:-1], extra=extra)
        else:
            self.host.compile_cache[key](*args)
        return out, lse


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch):
    monkeypatch.setattr(fa4_direct, "_verified", {})


def make_call(fake):
    plan_tensors = dict(table=torch.arange(6.0), aux=[torch.ones(3)])
    return DirectCall(fake.public, fake.host, **plan_tensors), plan_tensors


def qkv(seed, n=5):
    g = torch.Generator().manual_seed(seed)
    r = lambda rows, heads: torch.randn(rows, heads, 8, generator=g).half()
    return r(n, 4), r(7, 2), r(7, 2)


def fa4s_own(how, q, k, v, return_lse, **plan_tensors):
    return FakeFA4(how).public(q, k, v, softmax_scale=0.5, softcap=0.0, return_lse=return_lse, **plan_tensors)


@pytest.mark.parametrize("return_lse", [False, True])
def test_later_calls_skip_the_public_function(return_lse):
    fake = FakeFA4()
    call, plan_tensors = make_call(fake)
    for seed in range(4):
        q, k, v = qkv(seed)
        got = call(q, k, v, 0.5, 0.0, return_lse)
        assert all(map(same_bits, got, fa4s_own("plain", q, k, v, return_lse, **plan_tensors)))
        assert got[1] is None or got[1].shape == (4, 5)
    # recorded on the first call, checked against it on the second, direct on the others
    assert (fake.public_calls, fake.compiled_calls) == (2, 5)
    assert isinstance(fake.host.compile_cache, Cache)  # the recorder is gone
    (rec,) = call.records.values()
    assert isinstance(rec, Record) and rec.trusted
    assert sorted(j for _, j in rec.slots) == list(range(4 + return_lse))  # q, k, v, out (, lse) found
    assert all(rec.args[i] is None for i, _ in rec.slots)  # and not kept
    other, _ = make_call(fake)  # another plan, same compiled function: checked already
    for seed in range(2):
        other(*qkv(seed), 0.5, 0.0, return_lse)
    assert (fake.public_calls, fake.compiled_calls) == (3, 7)
    q, k, v = qkv(9, n=6)  # a new call shape is recorded anew
    call(q, k, v, 0.5, 0.0, return_lse)
    assert fake.public_calls == 4 and len(call.records) == 2


@pytest.mark.parametrize("how", ["copies q", "two calls", "object", "nested q", "keywords", "stale"])
def test_what_the_recording_does_not_understand_stays_on_the_public_function(how):
    fake = FakeFA4(how)
    call, plan_tensors = make_call(fake)
    for seed in range(3):
        q, k, v = qkv(seed)
        got = call(q, k, v, 0.5, 0.0, True)
        assert all(map(same_bits, got, fa4s_own(how, q, k, v, True, **plan_tensors)))
    assert list(call.records.values()) == [PUBLIC]
    assert fake.public_calls == 3  # the stale record was called once, for its check
    assert fake.compiled_calls == 3 * (1 + (how == "two calls")) + (how == "stale")
    assert fa4_direct._verified == ({} if how != "stale" else {(torch.float16, 8, True): False})


def test_aliased_or_autograd_inputs_are_not_recorded():
    fake = FakeFA4()
    call, _ = make_call(fake)
    q, k, _ = qkv(0)
    call(q, k, k, 0.5, 0.0, False)  # which of k, v is which: a guess
    call(q.requires_grad_(), k, k.clone(), 0.5, 0.0, False)  # FA4's Function keeps what backward needs
    assert call.records == {} and fake.public_calls == 2
    call(*qkv(1), 0.5, 0.0, False)
    assert isinstance(next(iter(call.records.values())), Record)


def test_inputs_less_aligned_than_recorded_take_the_public_function():
    fake = FakeFA4()
    call, plan_tensors = make_call(fake)
    for seed in range(2):
        call(*qkv(seed), 0.5, 0.0, False)
    q, k, v = qkv(2)
    odd = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)  # 2 bytes off
    got = call(odd, k, v, 0.5, 0.0, False)
    assert fake.public_calls == 3 and same_bits(got[0], fa4s_own("plain", q, k, v, False, **plan_tensors)[0])


def test_public_errors_pass_through_and_a_missing_cache_means_public():
    fake = FakeFA4("raises")
    call, _ = make_call(fake)
    with pytest.raises(ValueError, match="multiple of 8"):
        call(*qkv(0), 0.5, 0.0, False)
    assert isinstance(fake.host.compile_cache, Cache) and call.records == {}
    fake = FakeFA4()
    call = DirectCall(fake.public, None, table=torch.arange(6.0), aux=[torch.ones(3)])
    for seed in range(2):
        call(*qkv(seed), 0.5, 0.0, False)
    assert fake.public_calls == 2 and list(call.records.values()) == [PUBLIC]


def fake_fa4_package(monkeypatch) -> dict:
    """FA4's modules with one stand-in kernel: ``out = q * scale + sum(k) + 2 sum(v)`` (sums the
    zero rows between sequences leave alone) and ``lse`` the sum of each query's row, in FA4's
    output shapes. Returns the call counts."""
    counts = {"public": 0, "kernel": 0}

    def kernel(q, k, v, out, lse, scale, aux, cu_q, used, causal):
        counts["kernel"] += 1
        at = lambda a, n: torch.arange(a, a + n)
        value = q.float() * scale + k.float().sum() + 2 * v.float().sum() + (not causal)  # +1: non-causal
        rows = slice(None) if used is None else torch.cat([at(a, n) for a, n in zip(cu_q, used)])
        out[rows] = value[rows].to(out.dtype)  # with seqused_q, only the rows it uses
        if lse is not None:
            lse[..., rows] = q.float().sum(-1).transpose(-1, -2)[..., rows]

    def fwd(q, k, v, softmax_scale, return_lse, aux, out=None, lse=None, seqused_q=None, cu_seqlens_q=None,
            causal=True):  # fmt: skip
        counts["public"] += 1
        key, cache = (q.dim(), return_lse, causal), inner.compile_cache  # the one recordings swap
        if key not in cache:
            cache[key] = kernel
        out = torch.empty_like(q) if out is None else out  # lse [Hq, rows] (varlen) or [1, Hq, rows]
        if return_lse and lse is None:
            lse = torch.empty(*q.shape[:-3], q.shape[-2], q.shape[-3])
        cache[key](q, k, v, out, lse, softmax_scale, aux, cu_seqlens_q, seqused_q, causal)
        return out, lse, None, None, None

    def flash_attn_varlen_func(q, k, v, *, softmax_scale, return_lse, cu_seqlens_k, causal, **_):
        return fwd(q, k, v, softmax_scale, return_lse, [cu_seqlens_k], causal=causal)[:2]

    def inner(q, k, v, *, softmax_scale, return_lse, cu_seqlens_k, out=None, lse=None, seqused_q=None,
              cu_seqlens_q=None, window_size_left=None, window_size_right=None, causal=False,
              **_):  # fmt: skip
        rows = dict(seqused_q=seqused_q, cu_seqlens_q=cu_seqlens_q)
        return fwd(q, k, v, softmax_scale, return_lse, [cu_seqlens_k], out, lse, causal=causal, **rows)

    def flash_attn_func(q, k, v, *, softmax_scale, return_lse, aux_tensors, block_sparse_tensors, **_):
        return fwd(q, k, v, softmax_scale, return_lse, aux_tensors + list(block_sparse_tensors[:4]))[:2]

    interface = types.ModuleType("flash_attn.cute.interface")
    inner.compile_cache = Cache()
    interface._flash_attn_fwd = inner
    for fn in (flash_attn_func, flash_attn_varlen_func):
        fn.__module__ = interface.__name__
        setattr(interface, fn.__name__, fn)
    block_sparsity = types.ModuleType("flash_attn.cute.block_sparsity")
    fields = "mask_block_cnt mask_block_idx full_block_cnt full_block_idx block_size"
    block_sparsity.BlockSparseTensorsTorch = collections.namedtuple("BlockSparseTensorsTorch", fields)
    package = {"flash_attn": types.ModuleType("flash_attn"), "flash_attn.cute": interface}
    package |= {interface.__name__: interface, block_sparsity.__name__: block_sparsity}
    for name, mod in package.items():
        monkeypatch.setitem(sys.modules, name, mod)
    fa4_flags.inner_forward.cache_clear()
    monkeypatch.setattr(fa4_flags, "inner_forward", fa4_flags.inner_forward)  # cleared again after
    return counts


@pytest.mark.parametrize("case", ["builtin", "sparse"])
def test_the_fa4_backend_calls_fa4s_kernel_directly(monkeypatch, case):
    """Its forward with FA4's modules stood in for: rows moved onto tiles and back, recorded,
    checked, then direct."""
    counts = fake_fa4_package(monkeypatch)
    monkeypatch.setattr(fa4, "_interval_mask_mod", lambda: "interval")  # FA4's needs cutlass
    plan = step(case)
    assert fa4.builtin(plan) is (case == "builtin") and fa4.copies(plan, 16)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randint(-3, 4, (n, h, 16), generator=g).half() for n, h in
                   ((plan.total_q, 4), (plan.total_k, 2), (plan.total_k, 2)))  # fmt: skip
        out, lse = fa4.forward(q, k, v, plan, scale=0.5, return_lse=True)
        assert torch.equal(out, (q.float() * 0.5 + k.float().sum() + 2 * v.float().sum()).half())
        assert torch.equal(lse, q.float().sum(-1))
    assert counts == {"public": 2, "kernel": 4}


def test_causal_and_noncausal_sequences_take_one_launch_each_into_one_output(monkeypatch):
    """Chunks and canvases without spans: FA4's built-in kernel once per flag (the canvases'
    longer walks first), each writing only its sequences' rows of the shared output and LSE;
    both launches recorded, checked, then direct."""
    counts = fake_fa4_package(monkeypatch)
    seqs = [sa.Seq(40, kv_len=64), sa.Seq(8, kv_len=64, causal=False), sa.Seq(24, kv_len=32)]
    plan = sa.plan(sa.Batch(seqs), sa.LayerMask(window=16))
    assert fa4.builtin(plan) and fa4_flags.flags(plan) == (False, True) and fa4.copies(plan, 16)  # keys moved
    canvas = torch.cat([torch.full((s.q_len,), float(not s.causal)) for s in seqs])[:, None, None]
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randint(-3, 4, (n, h, 16), generator=g).half() for n, h in
                   ((plan.total_q, 4), (plan.total_k, 2), (plan.total_k, 2)))  # fmt: skip
        out, lse = fa4.forward(q, k, v, plan, scale=0.5, return_lse=True)
        assert torch.equal(out, (q.float() * 0.5 + k.float().sum() + 2 * v.float().sum() + canvas).half())
        assert torch.equal(lse, q.float().sum(-1))
    # per launch: recorded (1 public), checked (1 direct + 1 public into zeroed copies, then 1
    # direct into the call's output), direct (1)
    assert counts == {"public": 4, "kernel": 10}
    calls = fa4._lowering(plan, q, k)[0].calls
    assert [c.fixed["causal"] for c in calls] == [False, True]
    assert [c.fixed["window_size"] for c in calls] == [(15, 15), (15, 0)]
    assert all(isinstance(r, Record) and r.trusted for c in calls for r in c.records.values())


def test_fa4_refuses_both_flags_without_a_shared_output_forward(monkeypatch):
    fake_fa4_package(monkeypatch)
    monkeypatch.setattr(fa4_flags, "inner_forward", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    plan = sa.plan(sa.Batch([sa.Seq(8), sa.Seq(8, causal=False)]), sa.LayerMask())
    q = torch.empty(16, 2, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert "_flash_attn_fwd lacks" in fa4.unavailable(q, plan)
    one_flag = sa.plan(sa.Batch([sa.Seq(8, causal=False)] * 2), sa.LayerMask())
    assert fa4.unavailable(q, one_flag) is None


DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = {  # built-in (keys moved onto tiles), sparse (spans, rows moved), sparse with span groups
    "builtin": ([(300, 900, []), (20, 50, [])], {}),
    "sparse": ([(300, 900, [(400, 699)]), (1, 50, [])], {"spans": "on"}),
    "groups": ([(1024, 1024, [(16, 271, 0), (288, 543, 0)])], {"window": 512, "spans": "clamp"}),
    # built-in, one launch per causal flag into one output (keys moved onto tiles)
    "flags": ([(300, 900, []), (256, 512, [], False), (40, 200, [])], {"window": 200}),
}


def step(case: str, device="cpu"):
    seqs, layer = CASES[case]
    batch = sa.Batch([sa.Seq(q_len=t[0], kv_len=t[1], spans=t[2], causal=(t + (True,))[3]) for t in seqs])
    return sa.plan(batch, sa.LayerMask(**layer), device=device)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("return_lse", [False, True])
def test_fa4_direct_calls_give_fa4s_own_bits(case, return_lse):
    plan = lambda: step(case, DEV)
    p = plan()
    g = torch.Generator(device=p.cu_seqlens_q.device).manual_seed(0)
    rand = lambda n, h: torch.randn(n, h, 128, generator=g, device=g.device, dtype=torch.bfloat16)
    if fa4.unavailable(rand(1, 4), p):
        pytest.skip(fa4.unavailable(rand(1, 4), p))
    for _ in range(3):  # recorded, checked, direct
        q, k, v = rand(p.total_q, 4), rand(p.total_k, 2), rand(p.total_k, 2)
        got = fa4.forward(q, k, v, p, scale=0.1, return_lse=return_lse)
        want = fa4.forward(q, k, v, plan(), scale=0.1, return_lse=return_lse)  # a new plan: FA4's call
        assert all(map(same_bits, got, want))
    call = fa4._lowering(p, q, k)[0]
    calls = getattr(call, "calls", [call])  # one per causal flag
    assert all(isinstance(r, Record) and r.trusted for c in calls for r in c.records.values())
    for c in calls:
        c.fn = None  # direct calls never reach FA4's public function
    assert same_bits(fa4.forward(q, k, v, p, scale=0.1, return_lse=return_lse)[0], got[0])


@pytest.mark.skipif(DEV != "cuda", reason="a CUDA graph")
def test_launches_per_flag_replay_in_a_cuda_graph():
    """The flag launches' side stream forks from and joins the capturing stream: one graph
    replays new inputs with FA4's bits."""
    p = step("flags", DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    rand = lambda n, h: torch.randn(n, h, 128, generator=g, device=DEV, dtype=torch.bfloat16)
    q, k, v = rand(p.total_q, 4), rand(p.total_k, 2), rand(p.total_k, 2)
    if fa4.unavailable(q, p):
        pytest.skip(fa4.unavailable(q, p))
    for _ in range(3):  # recorded, checked, direct: capture runs the direct calls
        fa4.forward(q, k, v, p, scale=0.1, return_lse=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fa4.forward(q, k, v, p, scale=0.1, return_lse=True)
    for _ in range(2):
        fresh = rand(p.total_q, 4), rand(p.total_k, 2), rand(p.total_k, 2)
        for t, f in zip((q, k, v), fresh):
            t.copy_(f)
        graph.replay()
        want = fa4.forward(*fresh, step("flags", DEV), scale=0.1, return_lse=True)  # FA4's own call
        assert same_bits(out, want[0]) and same_bits(lse, want[1])
