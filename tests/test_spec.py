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
        ({"q_len": 2.0}, r"Seq.q_len must be an int"),
        ({"q_len": 2, "causal": 1}, r"Seq.causal must be a bool"),
    ],
)
def test_seq_rules(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sa.Seq(**kwargs)


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
    with pytest.raises(ValueError, match="softcap must be > 0"):
        sa.attention(q, k, v, p, softcap=-1.0)
    with pytest.raises(TypeError, match="plan must be a spanattn.Plan"):
        sa.attention(q, k, v, None)
