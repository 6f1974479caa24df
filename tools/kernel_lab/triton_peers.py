"""The peers gpu_triton.py times next to our kernel on one step: compiled FlexAttention with its
per-step ``create_block_mask`` (mask_mod reading the plan's per-token intervals), and SDPA (flash
causal where the mask is plain causal, each sequence's dense mask otherwise)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

DEV = "cuda"


def flex_time(p, d, q, k, v):
    """Kernel ms of compiled FlexAttention, its create_block_mask ms, its first-call seconds."""
    fn, bm_ms, compile_s = flex_fn(p, d, q, k, v)
    return do_bench(fn, warmup=25, rep=100, return_mode="median"), bm_ms, compile_s


def flex_fn(p, d, q, k, v):
    """A call of compiled FlexAttention (static shapes) over a create_block_mask BlockMask of
    the plan's mask, the mask build's ms, and the first call's seconds (compilation)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q_lens = torch.tensor([s.q_len for s in p.batch.seqs], device=DEV)
    kv_lens = p.seq_lens.long()
    seq_q = torch.repeat_interleave(torch.arange(p.num_seqs, device=DEV), q_lens)
    seq_k = torch.repeat_interleave(torch.arange(p.num_seqs, device=DEV), kv_lens)
    cu_k, lo, hi = p.cu_seqlens_k, p.lo, p.hi

    def mask_mod(b, h, q_idx, kv_idx):
        s = seq_q[q_idx]
        kl = kv_idx - cu_k[s]
        return (seq_k[kv_idx] == s) & (kl >= lo[q_idx]) & (kl <= hi[q_idx])

    build = lambda: create_block_mask(mask_mod, 1, None, p.total_q, p.total_k, device=DEV)
    bm = build()
    ts = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        bm = build()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    fc = torch.compile(flex_attention, dynamic=False)
    qf, kf, vf = (x.transpose(0, 1)[None] for x in (q, k, v))
    fn = lambda: fc(qf, kf, vf, block_mask=bm, enable_gqa=True, scale=d**-0.5)
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t
    return fn, sorted(ts)[1], compile_s


def sdpa_time(sc, p, d, q, k, v):
    qf, kf, vf = (x.transpose(0, 1)[None] for x in (q, k, v))
    if sc.layer.spans == "off" and sc.layer.window is None and p.num_seqs == 1:
        fn = lambda: F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)
        kind = "sdpa causal"
    else:
        cu_q, cu_k = p.cu_seqlens_q.tolist(), p.cu_seqlens_k.tolist()
        masks = [p.to_dense(i) for i in range(p.num_seqs)]
        parts = [
            (
                qf[:, :, cu_q[i] : cu_q[i + 1]],
                kf[:, :, cu_k[i] : cu_k[i + 1]],
                vf[:, :, cu_k[i] : cu_k[i + 1]],
                m,
            )
            for i, m in enumerate(masks)
        ]
        fn = lambda: [
            F.scaled_dot_product_attention(a, b, c, attn_mask=m, enable_gqa=True) for a, b, c, m in parts
        ]
        kind = "sdpa dense mask"
    fn()
    return do_bench(fn, warmup=10, rep=60, return_mode="median"), kind
