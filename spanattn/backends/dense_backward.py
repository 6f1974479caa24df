"""The gradients of the dense backends (reference, sdpa) written out, from what the forward saved:
``out`` and ``lse``, nothing O(q x kv). Eager calls of those backends differentiate through
torch's autograd instead; this is their backward where autograd cannot reach into the call:
inside the torch op that torch.compile sees (ops.py, grad.py).

Per sequence, scores ``s = scale * q k^T`` (with a softcap ``c * tanh(s / c)``), ``p = exp(s -
lse)`` on the allowed pairs and exactly 0 elsewhere:

    dv = p^T dO        dp = dO v^T        ds = p * (dp - delta),  delta = rowsum(dO * O) - dlse
    dq = scale * ds k  dk = scale * ds^T q   (a softcap multiplies ds by 1 - tanh^2 first)

``dlse`` (the gradient reaching the LSE output) enters through ``d lse / d s = p``. dK and dV of
a KV head sum its query heads' (GQA).
"""

from __future__ import annotations

import torch

from .dense import per_sequence


def backward(
    q, k, v, out, lse, dout, plan, *, scale, softcap=None, dlse=None, compute_dtype=torch.float32
):  # fmt: skip
    """``dq, dk, dv`` (q's, k's and v's dtypes) of the step from the forward's ``out, lse``."""
    compute_dtype = torch.promote_types(compute_dtype, q.dtype)
    dq = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=compute_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=compute_dtype, device=v.device)
    group = q.shape[1] // k.shape[1]
    key_rows = {q0: (k0, kv_len) for _, q0, _, k0, kv_len in plan.host_layout()}
    for rows, mask, ki, vi in per_sequence(q, k, v, plan):
        k0, kv_len = key_rows[rows.start]
        qi, do, oi = (t[rows].to(compute_dtype).transpose(0, 1) for t in (q, dout, out))  # [Hq, L, D]
        ki, vi = ki.to(compute_dtype).transpose(0, 1), vi.to(compute_dtype).transpose(0, 1)  # [Hq, S, D]
        s = qi @ ki.transpose(1, 2) * scale
        if softcap:
            t = torch.tanh(s / softcap)
            s = softcap * t
        row_lse = lse[rows].to(compute_dtype).transpose(0, 1)[..., None]
        # where, not a multiply: a key the row does not see may hold NaN or Inf
        p = torch.where(mask, torch.exp(s - row_lse), 0.0)
        delta = (do * oi).sum(-1, keepdim=True)
        if dlse is not None:
            delta = delta - dlse[rows].to(compute_dtype).transpose(0, 1)[..., None]
        ds = torch.where(mask, p * (do @ vi.transpose(1, 2) - delta), 0.0)
        if softcap:
            ds = ds * (1 - t * t)
        dq[rows] = (ds @ ki * scale).transpose(0, 1)
        keys = slice(k0, k0 + kv_len)
        per_kv_head = lambda x: x.unflatten(0, (-1, group)).sum(1).transpose(0, 1)  # [S, Hkv, D]
        dk[keys] = per_kv_head(ds.transpose(1, 2) @ qi * scale)
        dv[keys] = per_kv_head(p.transpose(1, 2) @ do)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
