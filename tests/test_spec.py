"""Bad input gets a clear error that names the argument and the rule it broke."""

import pytest
import torch

import spanattn as sa


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"q_len": 0}, r"Seq.q_len must be >= 1"),
        ({"q_len": 5, "kv_len": 4}, r"Seq.kv_len \(4\) must be >= Seq.q_len \(5\)"),
        ({"q_len": 5, "spans": [(3, 1)]}, r"start > end"),
        ({"q_len": 5, "spans": [(-1, 2)]}, r"negative start"),
        ({"q_len": 9, "spans": [(1, 4), (4, 6)]}, r"Seq.spans overlap: \(1, 4\) and \(4, 6\)"),
        ({"q_len": 9, "spans": [(5, 9)]}, r"ends past the prompt"),
        ({"q_len": 9, "spans": [(5,)]}, r"\(start, end\) pair"),
        ({"q_len": 4, "kv_len": 8, "prompt_len": 6}, r"Seq.prompt_len must be >= 8"),
        ({"q_len": 2.0}, r"Seq.q_len must be an int, got 2.0 \(float\)"),
        ({"q_len": True}, r"Seq.q_len must be an int, got True \(a bool\)"),
        ({"q_len": 2, "causal": 1}, r"Seq.causal must be a bool"),
        # numbers the kernels would index past int32, or floats read as positions: refused
        ({"q_len": 1, "kv_len": 2**31}, r"Seq.kv_len = 2147483648 is over 2147483647, the int32 limit"),
        ({"q_len": 1, "kv_len": 10**30}, rf"Seq.kv_len = {10**30} is over 2147483647"),
        ({"q_len": 1, "kv_len": 5, "prompt_len": 2**32}, r"Seq.prompt_len = 4294967296 is over"),
        (
            {"q_len": 9, "spans": [(1.7, 4.2)]},
            r"Seq.spans: span \(1.7, 4.2\)'s start must be an int, got 1.7",
        ),
        ({"q_len": 9, "spans": [(1, float("nan"))]}, r"Seq.spans: span \(1, nan\)'s end must be an int"),
        ({"q_len": 9, "spans": [(True, 4)]}, r"span \(True, 4\)'s start must be an int, got True \(a bool\)"),
        ({"q_len": 9, "spans": None}, r"Seq.spans must be a sequence of \(start, end\).*got None"),
        ({"q_len": 9, "spans": [(1, 4, 0.5)]}, r"a span group must be an int >= 0 or None, got 0.5"),
    ],
)
def test_seq_rules(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sa.Seq(**kwargs)


def test_integers_of_any_kind_are_taken_as_ints():
    """numpy integers and one-element integer tensors are counts too; the Seq keeps Python ints."""
    np = pytest.importorskip("numpy")
    seq = sa.Seq(q_len=np.int64(3), kv_len=torch.tensor(9), spans=torch.tensor([[4, 6]]))
    assert seq == sa.Seq(q_len=3, kv_len=9, spans=[(4, 6)])
    assert type(seq.q_len) is int and type(seq.kv_len) is int and type(seq.spans[0][0]) is int
    assert sa.LayerMask(window=np.int32(4)) == sa.LayerMask(window=4)


def test_unsorted_spans_are_sorted():
    assert sa.Seq(q_len=20, spans=[(10, 12), (1, 3)]).spans == ((1, 3), (10, 12))


def test_layer_rules():
    with pytest.raises(ValueError, match="LayerMask.window must be >= 1"):
        sa.LayerMask(window=0)
    with pytest.raises(ValueError, match="LayerMask.spans must be one of"):
        sa.LayerMask(spans="bidirectional")
    with pytest.raises(ValueError, match="LayerMask.noncausal_window"):
        sa.LayerMask(noncausal_window="hf")
    assert hash(sa.LayerMask(window=4)) == hash(sa.LayerMask(window=4))


def test_chunk_that_cuts_a_span():
    seq = sa.Seq(q_len=4, kv_len=10, spans=[(6, 12)], prompt_len=20)
    with pytest.raises(ValueError, match=r"Batch.seqs\[0\].*inside span \(6, 12\).*allow_split_spans"):
        sa.Batch([seq])
    sa.Batch([seq], allow_split_spans=True)
    # a prefix-cache hit that ends mid-span is fine: the earlier KV came from a full pass
    sa.Batch([sa.Seq(q_len=4, kv_len=13, spans=[(6, 12)])])
    # a span wholly in a later chunk is ignored
    sa.Batch([sa.Seq(q_len=4, kv_len=10, spans=[(10, 12)], prompt_len=20)])


def test_batch_rules():
    with pytest.raises(ValueError, match="at least one Seq"):
        sa.Batch([])
    with pytest.raises(TypeError, match=r"Batch.seqs\[1\] must be a Seq"):
        sa.Batch([sa.Seq(3), (3, 3)])
    with pytest.raises(TypeError, match="plan\\(batch=...\\)"):
        sa.plan([sa.Seq(3)], sa.LayerMask())
    with pytest.raises(
        TypeError, match=r"Batch.seqs must be a list \(an iterable\) of Seq, got a Seq: wrap it"
    ):
        sa.Batch(sa.Seq(4))
    with pytest.raises(TypeError, match="Batch.allow_split_spans must be a bool, got 'yes'"):
        sa.Batch([sa.Seq(4)], allow_split_spans="yes")
    with pytest.raises(
        ValueError, match=r"LayerMask.window = 9223372036854775807 is over 4611686018427387904"
    ):
        sa.LayerMask(window=2**63 - 1)  # the interval kernels add windows to positions in int64
    assert sa.LayerMask(window=2**40).window == 2**40


def test_totals_past_int32_are_refused():
    """Each sequence fits int32 but the packed offsets would not."""
    big = sa.Seq(q_len=1, kv_len=2**31 - 1)
    with pytest.raises(
        ValueError, match=r"Batch: its sequences hold 4294967294 keys in all, over 2147483647"
    ):
        sa.Batch([big, big])
    sa.Batch([big])


def test_plan_device_is_checked_by_name():
    batch = sa.Batch([sa.Seq(4)])
    with pytest.raises(ValueError, match="plan\\(device=...\\) must be a torch device .* got 'gpu0'"):
        sa.plan(batch, sa.LayerMask(), device="gpu0")
    # no GPU here: torch's AssertionError before; with GPUs, one past the last
    missing = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match=rf"plan\(device=...\) = '{missing}', but "):
        sa.plan(batch, sa.LayerMask(), device=missing)


def _tensors(plan, hq=4, hkv=2, d=16, dtype=torch.float32):
    return (
        torch.randn(plan.total_q, hq, d, dtype=dtype),
        torch.randn(plan.total_k, hkv, d, dtype=dtype),
        torch.randn(plan.total_k, hkv, d, dtype=dtype),
    )


def test_attention_rules():
    p = sa.plan(sa.Batch([sa.Seq(q_len=3, kv_len=5)]), sa.LayerMask())
    q, k, v = _tensors(p)
    bad = [
        ((q[:2], k, v), ValueError, "q has 2 tokens but the plan packs 3"),
        ((q, k[:4], v), ValueError, "plan's 5 packed keys"),
        ((q[..., None], k, v), ValueError, r"q must be \[tokens, heads, head_dim\]"),
        ((q.long(), k, v), TypeError, "q.dtype must be one of"),
        ((q.half(), k, v), TypeError, "must share a dtype"),
        ((q, torch.randn(5, 3, 16), torch.randn(5, 3, 16)), ValueError, r"multiple of k/v heads \(3\)"),
        ((q, k, v[..., :8]), ValueError, "must share head_dim"),
        ((q, k, torch.randn(5, 1, 16)), ValueError, "same number of heads"),
    ]
    for args, exc, match in bad:
        with pytest.raises(exc, match=match):
            sa.attention(*args, p)
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        sa.attention(q, k, v, p, backend="cudnn")
    with pytest.raises(RuntimeError, match="backend='sdpa' cannot run this call: .*softcap"):
        sa.attention(q, k, v, p, backend="sdpa", softcap=30.0)
    with pytest.raises(ValueError, match="softcap must be finite and > 0"):
        sa.attention(q, k, v, p, softcap=-1.0)
    with pytest.raises(TypeError, match="plan must be a spanattn.Plan"):
        sa.attention(q, k, v, None)


BACKENDS = ["reference", "sdpa", "flex", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "opts, exc, match",
    [
        # scale <= 0 made the triton prefill kernel's masked scores -inf * 0 = NaN; nan/inf passed
        ({"scale": 0.0}, ValueError, r"scale must be finite and > 0 \(or None\), got 0.0"),
        ({"scale": -0.5}, ValueError, r"scale must be finite and > 0 \(or None\), got -0.5"),
        ({"scale": float("nan")}, ValueError, r"scale must be finite and > 0 \(or None\), got nan"),
        ({"scale": float("inf")}, ValueError, r"scale must be finite and > 0 \(or None\), got inf"),
        ({"scale": "x"}, TypeError, r"scale must be a real number \(or None\), got 'x' \(str\)"),
        ({"scale": True}, TypeError, r"scale must be a real number"),
        # softcap=inf passed the > 0 check and gave NaN everywhere
        ({"softcap": float("inf")}, ValueError, r"softcap must be finite and > 0 \(or None\), got inf"),
        ({"softcap": 0}, ValueError, r"softcap must be finite and > 0 \(or None\), got 0.0"),
        ({"softcap": "5"}, TypeError, r"softcap must be a real number \(or None\), got '5' \(str\)"),
    ],
)
def test_scale_and_softcap_rules(backend, opts, exc, match):
    """Refused before any backend runs, whichever is named."""
    p = sa.plan(sa.Batch([sa.Seq(q_len=3, kv_len=5)]), sa.LayerMask())
    q, k, v = _tensors(p)
    with pytest.raises(exc, match=match):
        sa.attention(q, k, v, p, backend=backend, **opts)


def test_scale_and_softcap_of_other_real_kinds():
    np = pytest.importorskip("numpy")
    p = sa.plan(sa.Batch([sa.Seq(q_len=3, kv_len=5)]), sa.LayerMask())
    q, k, v = _tensors(p)
    want = sa.attention(q, k, v, p, backend="reference", scale=0.25, softcap=5.0)
    for scale, softcap in ((np.float32(0.25), 5), (torch.tensor(0.25), np.float64(5.0))):
        got = sa.attention(q, k, v, p, backend="reference", scale=scale, softcap=softcap)
        assert torch.equal(got, want)


def test_zero_heads_and_head_dim_are_named():
    """ZeroDivisionError before: GQA's heads % kv_heads and the default 1 / sqrt(head_dim)."""
    p = sa.plan(sa.Batch([sa.Seq(q_len=3, kv_len=5)]), sa.LayerMask())
    q, k, v = _tensors(p)
    with pytest.raises(ValueError, match=r"k/v heads must be >= 1, got 0"):
        sa.attention(q, k[:, :0], v[:, :0], p)
    with pytest.raises(ValueError, match=r"head_dim must be >= 1, got 0"):
        sa.attention(q[..., :0], k[..., :0], v[..., :0], p)
    with pytest.raises(ValueError, match=r"q heads must be >= 1, got 0"):
        sa.attention(q[:, :0], k, v, p)
