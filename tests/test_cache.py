"""The paged cache helpers: write_kv_cache (torch path and Triton kernel under the interpreter),
slot_mapping, gather_kv, and the checks on paged arguments."""

import pytest
import torch

import spanattn as sa
from spanattn.cache import gather_kv, slot_mapping


def _setup(block_size=16, seed=0):
    batch = sa.Batch([sa.Seq(q_len=3, kv_len=40), sa.Seq(q_len=1, kv_len=17), sa.Seq(q_len=5, kv_len=5)])
    p = sa.plan(batch, sa.LayerMask())
    g = torch.Generator().manual_seed(seed)
    bt = torch.randperm(12, generator=g)[:9].int().view(3, 3)
    return p, bt


def _brute_slots(p, bt, block_size, new_only):
    slots = []
    for i, s in enumerate(p.batch.seqs):
        first = s.kv_len - s.q_len if new_only else 0
        slots += [
            int(bt[i, pos // block_size]) * block_size + pos % block_size for pos in range(first, s.kv_len)
        ]
    return torch.tensor(slots)


def test_slot_mapping_and_gather():
    p, bt = _setup()
    assert torch.equal(slot_mapping(p, bt, 16), _brute_slots(p, bt, 16, True))
    kc, vc = torch.randn(12, 16, 2, 8), torch.randn(12, 16, 2, 8)
    k, v = gather_kv(kc, vc, bt, p)
    every = _brute_slots(p, bt, 16, False)
    assert torch.equal(k, kc.view(-1, 2, 8)[every]) and torch.equal(v, vc.view(-1, 2, 8)[every])


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_write_kv_cache(kernel):
    p, bt = _setup()
    slots = slot_mapping(p, bt, 16)
    slots[2] = -1  # a padding token: skipped
    k, v = torch.randn(p.total_q, 2, 8), torch.randn(p.total_q, 2, 8)
    kc, vc = torch.zeros(12, 16, 2, 8), torch.zeros(12, 16, 2, 8)
    if kernel == "torch":
        sa.write_kv_cache(k, v, kc, vc, slots)
    else:  # on the GPU when there is one, else under the interpreter
        pytest.importorskip("triton")
        from spanattn.backends.triton.cache_write import write_kv_cache_triton

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        kd, vd = kc.to(dev), vc.to(dev)
        write_kv_cache_triton(k.to(dev), v.to(dev), kd, vd, slots.to(dev))
        kc, vc = kd.cpu(), vd.cpu()
    keep = slots >= 0
    want_k, want_v = torch.zeros(12 * 16, 2, 8), torch.zeros(12 * 16, 2, 8)
    want_k[slots[keep]], want_v[slots[keep]] = k[keep], v[keep]
    assert torch.equal(kc.view(-1, 2, 8), want_k) and torch.equal(vc.view(-1, 2, 8), want_v)


def test_write_kv_cache_errors():
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    kc, vc = torch.zeros(3, 16, 2, 8), torch.zeros(3, 16, 2, 8)
    ok = torch.tensor([0, 5, 47, -1])
    sa.write_kv_cache(k, v, kc, vc, ok)
    with pytest.raises(IndexError, match=r"slot_mapping\[2\] = 48 is out of range"):
        sa.write_kv_cache(k, v, kc, vc, torch.tensor([0, 5, 48, -1]))
    with pytest.raises(TypeError, match="v.dtype"):
        sa.write_kv_cache(k, v.half(), kc, vc, ok)
    with pytest.raises(ValueError, match="k must be"):
        sa.write_kv_cache(k[:, :1], v, kc, vc, ok)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        sa.write_kv_cache(k, v, kc, vc, ok[:3])
    with pytest.raises(TypeError, match="slot_mapping must be int32 or int64"):
        sa.write_kv_cache(k, v, kc, vc, ok.float())
    with pytest.raises(ValueError, match="v_cache"):
        sa.write_kv_cache(k, v, kc, vc[:2], ok)
    with pytest.raises(ValueError, match="slot_mapping is on meta"):
        sa.write_kv_cache(k, v, kc, vc, ok.to("meta"))


def test_write_kv_cache_refuses_writes_that_would_overwrite_each_other():
    """Duplicate slots (the last write won, on the GPU in no fixed order) and caches that share
    memory (each value overwrote a key); FlashInfer's interleaved K and V halves share none."""
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    kc, vc = torch.zeros(3, 16, 2, 8), torch.zeros(3, 16, 2, 8)
    with pytest.raises(
        ValueError, match=r"slot_mapping\[0\] and slot_mapping\[2\] are both 5: slots must be distinct"
    ):
        sa.write_kv_cache(k, v, kc, vc, torch.tensor([5, -1, 5]))
    sa.write_kv_cache(k, v, kc, vc, torch.tensor([-1, 5, -1]))  # padding may repeat
    with pytest.raises(ValueError, match="k_cache and v_cache are one tensor"):
        sa.write_kv_cache(k, v, kc, kc, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        sa.write_kv_cache(k, v, kc[:2], kc[1:], torch.tensor([0, 1, 2]))
    for kernel in ("torch", "triton"):
        kv = torch.zeros(3, 2, 16, 2, 8)  # [num_blocks, 2, block_size, Hkv, D]
        slots = torch.tensor([0, 17, 47])
        if kernel == "torch":
            sa.write_kv_cache(k, v, kv[:, 0], kv[:, 1], slots)
        else:  # the GPU's writer (under the interpreter here) reads the same strides
            pytest.importorskip("triton")
            from spanattn.backends.triton.cache_write import write_kv_cache_triton

            dev = "cuda" if torch.cuda.is_available() else "cpu"
            kvd = kv.to(dev)
            write_kv_cache_triton(k.to(dev), v.to(dev), kvd[:, 0], kvd[:, 1], slots.to(dev))
            kv = kvd.cpu()
        assert torch.equal(kv[:, 0].reshape(-1, 2, 8)[slots], k)
        assert torch.equal(kv[:, 1].reshape(-1, 2, 8)[slots], v)
        assert kv.count_nonzero() == k.count_nonzero() + v.count_nonzero()


def test_write_kv_cache_names_the_layout_it_expects():
    """A head-major cache, as given or viewed in NHD order, and a strided head_dim: refused
    naming the layout (torch's view error from inside cache.py before, or heads read as tokens)."""
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    head_major = torch.zeros(4, 2, 16, 8)  # [num_blocks, Hkv, block_size, D]
    want = r"k must be \[tokens, kv_heads, head_dim\] = \[tokens, 16, 8\] to match k_cache \[num_blocks, "
    with pytest.raises(ValueError, match=want + r"block_size, kv_heads, head_dim\].*head-major"):
        sa.write_kv_cache(k, v, head_major, head_major.clone(), torch.tensor([0, 1, 2]))
    want = r"k_cache must hold pages laid out \[num_blocks, block_size, kv_heads, head_dim\].*strides "
    with pytest.raises(ValueError, match=want + r"\(256, 8, 128, 1\); that is a head-major cache"):
        sa.write_kv_cache(k, v, head_major.transpose(1, 2), torch.zeros(4, 16, 2, 8), torch.tensor([0, 1, 2]))
    strided = torch.zeros(4, 16, 2, 16)[..., ::2]
    with pytest.raises(ValueError, match=r"v_cache must hold pages laid out"):
        sa.write_kv_cache(k, v, torch.zeros(4, 16, 2, 8), strided, torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="check_slots must be None, True or False, got 1"):
        sa.write_kv_cache(k, v, torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8), torch.tensor([0, 1, 2]),
                          check_slots=1)  # fmt: skip


def test_paged_attention_argument_errors():
    p, bt = _setup()
    q = torch.randn(p.total_q, 4, 8)
    kc = vc = torch.randn(12, 16, 2, 8)
    sa.attention(q, kc, vc, p, block_table=bt, backend="reference")
    with pytest.raises(TypeError, match="block_table must be int32"):
        sa.attention(q, kc, vc, p, block_table=bt.long())
    with pytest.raises(ValueError, match=r"block_table must be \[num_seqs=3"):
        sa.attention(q, kc, vc, p, block_table=bt[:2])
    with pytest.raises(ValueError, match="sequence 0 has kv_len 40, which needs 3 blocks"):
        sa.attention(q, kc, vc, p, block_table=bt[:, :2].contiguous())
    with pytest.raises(ValueError, match="block_size"):
        sa.attention(q, kc.view(24, 8, 2, 8), vc.view(24, 8, 2, 8), p, block_table=bt)
    head_major = torch.randn(3, 2, 40, 8)  # transformers' [batch, Hkv, tokens, D]
    want = r"k.shape\[1\] \(block_size, in the paged layout \[num_blocks, block_size, kv_heads, head_dim\]\) "
    with pytest.raises(ValueError, match=want + r"must be one of .*, got 2 .*head-major"):
        sa.attention(q, head_major, head_major, p, block_table=bt)
    with pytest.raises(TypeError, match=r"block_size must be an int, got 16.0"):
        slot_mapping(p, bt, 16.0)
    with pytest.raises(ValueError, match="k must be a paged cache"):
        sa.attention(q, kc.view(-1, 2, 8), vc, p, block_table=bt)
    with pytest.raises(ValueError, match="q heads"):
        sa.attention(q[:, :3], kc, vc, p, block_table=bt)


def test_backend_without_paged_support_says_so(monkeypatch):
    from spanattn import backends

    p, bt = _setup()
    q, kc = torch.randn(p.total_q, 2, 8), torch.randn(12, 16, 2, 8)
    fake = type("M", (), {"unavailable": staticmethod(lambda q, plan, **o: None), "forward": lambda q: q})
    monkeypatch.setattr(backends, "load", lambda name: fake)
    with pytest.raises(RuntimeError, match="not a paged cache"):
        sa.attention(q, kc, kc, p, block_table=bt, backend="reference")


def test_slot_mapping_names_the_device_plans_own():
    from spanattn.cache import slot_mapping as host_slots

    with pytest.raises(TypeError, match="device plan has its own plan.slot_mapping"):
        host_slots(object(), torch.zeros(1, 1, dtype=torch.int32), 16)
