"""docs/design.md section 4's numerics rule, written once for the tests, the demo, the bench and
the GPU scripts: a result in dtype X passes when

    err(result vs fp64 truth) <= 2 * err(the reference computed in X vs fp64 truth) + 1e-4

(max abs error, FA4's rule), for the output and the LSE alike, and for each of dq, dk, dv
(``GradTruth``: torch autograd through the reference, in fp64 for the truth). NaN never passes.

>>> import torch, spanattn as sa
>>> p = sa.plan(sa.Batch([sa.Seq(q_len=5, spans=[(1, 3)])]), sa.LayerMask(window=2))
>>> q = torch.randn(5, 2, 16); k = v = torch.randn(5, 1, 16)
>>> Truth(q, k, v, p).check(sa.attention(q, k, v, p)).ok
True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .backends import reference


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference; inf when either side holds NaN (NaN must never pass a bound)."""
    d = (a.double() - b.double()).abs().max().item()
    return d if d == d else float("inf")


@dataclass
class Verdict:
    err: float
    bound: float
    lse_err: float | None = None
    lse_bound: float | None = None

    @property
    def ok(self) -> bool:
        lse_ok = self.lse_err is None or self.lse_err <= self.lse_bound
        return self.err <= self.bound and lse_ok

    def as_dict(self) -> dict:
        """For JSON reports: the four numbers and ``ok``."""
        return {**asdict(self), "ok": self.ok}

    def __str__(self) -> str:
        s = f"err {self.err:.3g} (bound {self.bound:.3g})"
        if self.lse_err is not None:
            s += f", LSE err {self.lse_err:.3g} (bound {self.lse_bound:.3g})"
        return s


class Truth:
    """fp64 truth and the same-dtype reference of one call, computed once and held against any
    number of results (every backend of the demo, a kernel and its paged twin)."""

    def __init__(self, q, k, v, plan, *, scale: float | None = None, softcap=None, block_table=None):
        opts = dict(
            scale=q.shape[-1] ** -0.5 if scale is None else scale,
            softcap=softcap,
            block_table=block_table,
            return_lse=True,
        )
        self.out, self.lse = reference.forward(q, k, v, plan, compute_dtype=torch.float64, **opts)
        same, same_lse = reference.forward(q, k, v, plan, compute_dtype=q.dtype, **opts)
        self.bound = 2 * max_err(same, self.out) + 1e-4
        self.lse_bound = 2 * max_err(same_lse, self.lse) + 1e-4

    def check(self, out, lse=None, *, rounding_slack: bool = False) -> Verdict:
        """rounding_slack: allow one extra rounding step of ``out``'s dtype per element. On tiny
        steps the same-dtype reference can round every element exactly like the truth (error ~0)
        while a kernel summing in another order lands one ulp away."""
        verdict = _verdict(out, self.out, self.bound, rounding_slack)
        if lse is not None:
            verdict.lse_err, verdict.lse_bound = max_err(lse, self.lse), self.lse_bound
        return verdict


def _verdict(result, truth, bound: float, rounding_slack: bool) -> Verdict:
    """``result`` against ``truth`` under ``bound``; with ``rounding_slack`` the bound grows by
    what one ulp of ``result``'s dtype per element explains (Truth.check)."""
    err = max_err(result, truth)
    if not rounding_slack or err == float("inf"):
        return Verdict(err, bound)
    truth = truth.double()
    ulp = torch.finfo(result.dtype).eps * torch.exp2(torch.floor(torch.log2(truth.abs().clamp_min(1e-30))))
    excess = ((result.double() - truth).abs() - ulp).clamp_min(0).max().item()
    return Verdict(err, bound + (err - excess))


@dataclass
class GradVerdict:
    """One :class:`Verdict` per gradient; ``ok`` when all three pass."""

    dq: Verdict
    dk: Verdict
    dv: Verdict

    @property
    def ok(self) -> bool:
        return self.dq.ok and self.dk.ok and self.dv.ok

    def as_dict(self) -> dict:
        return {"dq": self.dq.as_dict(), "dk": self.dk.as_dict(), "dv": self.dv.as_dict(), "ok": self.ok}

    def __str__(self) -> str:
        return f"dq {self.dq}; dk {self.dk}; dv {self.dv}"


class GradTruth:
    """The rule for gradients: dq, dk, dv of one call against torch autograd through the
    reference in fp64 (the truth, on fp64 copies of the inputs) and in the inputs' dtype (the
    bound), for the output's gradient ``dout`` and, if given, the LSE output's ``dlse``:

        err(g vs truth) <= 2 * err(same-dtype reference vs truth) + 1e-4

    where the same-dtype reference's error is the larger of autograd's through the reference in
    the dtype and that of the exact backward (fp64 math) from the forward's output rounded to
    the dtype. Every flash backward reads that output (``delta = rowsum(dO * O)``), which the
    reference's own softmax backward never rounds: on a small fp16 step its rounding alone, not
    the kernel, can exceed twice a lucky reference's error (a 2-key window: dk 1.6e-3 from the
    rounded output, 5.5e-4 autograd's in fp16).

    >>> import torch, spanattn as sa
    >>> p = sa.plan(sa.Batch([sa.Seq(q_len=5, spans=[(1, 3)])]), sa.LayerMask(window=2))
    >>> q, k, v = torch.randn(5, 2, 16), torch.randn(5, 1, 16), torch.randn(5, 1, 16)
    >>> t = GradTruth(q, k, v, p, torch.randn(5, 2, 16))
    >>> t.check(*t.grads).ok
    True
    """

    def __init__(self, q, k, v, plan, dout, dlse=None, *, scale: float | None = None, softcap=None):
        opts = dict(scale=q.shape[-1] ** -0.5 if scale is None else scale, softcap=softcap)
        self.grads = _reference_grads(q, k, v, plan, dout, dlse, torch.float64, opts)
        same = _reference_grads(q, k, v, plan, dout, dlse, q.dtype, opts)
        from_output = _rounded_output_grads(q, k, v, plan, dout, dlse, opts)
        self.bounds = [
            2 * max(max_err(a, t), max_err(b, t)) + 1e-4 for a, b, t in zip(same, from_output, self.grads)
        ]

    def check(self, dq, dk, dv, *, rounding_slack: bool = False) -> GradVerdict:
        """rounding_slack: as :meth:`Truth.check`, one extra rounding of each gradient's dtype per
        element (a backward stores dq, dk, dv in q's dtype; on a tiny fp16 step the reference in
        fp16 can land on the truth's rounding where a kernel summing otherwise lands one ulp off:
        torch's own CPU SDPA backward did, dq 8.4e-4 on a 4-key row against a bound of 7.0e-4)."""
        pairs = zip((dq, dk, dv), self.grads, self.bounds)
        return GradVerdict(*(_verdict(g, t, b, rounding_slack) for g, t, b in pairs))


def _rounded_output_grads(q, k, v, plan, dout, dlse, opts) -> tuple:
    """dq, dk, dv in fp64 math from the fp64 forward's output rounded to q's dtype: the best a
    backward given that output can do."""
    from .backends.dense_backward import backward

    x = [t.detach().double() for t in (q, k, v)]
    out, lse = reference.forward(*x, plan, compute_dtype=torch.float64, return_lse=True, **opts)
    out = out.to(q.dtype).double()
    dl = None if dlse is None else dlse.double()
    return backward(*x, out, lse, dout.double(), plan, dlse=dl, compute_dtype=torch.float64, **opts)


def _reference_grads(q, k, v, plan, dout, dlse, dtype, opts) -> tuple:
    """dq, dk, dv of ``reference.forward`` computed in ``dtype`` on copies of the inputs in it."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference.forward(*leaves, plan, compute_dtype=dtype, return_lse=True, **opts)
    outs, grads = [out], [dout.to(dtype)]
    if dlse is not None:
        outs.append(lse)
        grads.append(dlse.to(lse.dtype))  # the reference LSE is fp32 whatever it computes in
    return torch.autograd.grad(outs, leaves, grads)
