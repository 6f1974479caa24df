"""The oracle: a dense mask from the intervals and plain softmax attention in fp32 (fp64 on
request), one sequence at a time. Runs anywhere; slow on purpose. In fp32 its two products are
exact_matmul's, so that its bits do not depend on the BLAS's threads or operand alignment."""

from __future__ import annotations

import torch

from ..exact_matmul import exact_matmul
from .dense import capture_refusal, outputs, per_sequence
from .dense_backward import backward as backward  # the op's backward under torch.compile

DEVICE_PLANS = True  # reads a device plan's lengths on the host: not while capturing a graph
# Eager calls with inputs that require grad differentiate through torch's autograd (``backward``
# is for the torch op under torch.compile, which autograd cannot see into).
NATIVE_AUTOGRAD = True


def unavailable(q, plan, **opts) -> str | None:
    return capture_refusal(q, plan)


def no_backward(q, plan, **opts) -> str | None:
    return None


def forward(
    q, k, v, plan, *, scale, softcap=None, return_lse=False, block_table=None, compute_dtype=torch.float32
):
    out, lse = outputs(q, v, return_lse, plan)
    compute_dtype = torch.promote_types(compute_dtype, q.dtype)
    matmul = exact_matmul if compute_dtype == torch.float32 else torch.matmul
    for rows, mask, ki, vi in per_sequence(q, k, v, plan, block_table):
        qi = q[rows].to(compute_dtype).transpose(0, 1)  # [Hq, q_len, D]
        ki, vi = ki.to(compute_dtype), vi.to(compute_dtype)
        scores = matmul(qi, ki.permute(1, 2, 0)) * scale  # [Hq, q_len, kv_len]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # never -inf: every row allows k = q
        probs = torch.exp(scores - row_lse[..., None])
        out[rows] = matmul(probs, vi.transpose(0, 1)).transpose(0, 1).to(q.dtype)
        if return_lse:
            lse[rows] = row_lse.transpose(0, 1).to(lse.dtype)
    return out, lse
