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
