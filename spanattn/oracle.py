"""DESIGN.md section 4's numerics rule, written once for the tests, the demo, the bench and
the GPU scripts: a result in dtype X passes when

    err(result vs fp64 truth) <= 2 * err(the reference computed in X vs fp64 truth) + 1e-4

(max abs error, FA4's rule), for the output and the LSE alike. NaN never passes.

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
        err = max_err(out, self.out)
        if rounding_slack and err != float("inf"):
            truth = self.out.double()
            ulp = torch.finfo(out.dtype).eps * torch.exp2(
                torch.floor(torch.log2(truth.abs().clamp_min(1e-30)))
            )
            excess = ((out.double() - truth).abs() - ulp).clamp_min(0).max().item()
            verdict = Verdict(err, self.bound + (err - excess))
        else:
            verdict = Verdict(err, self.bound)
        if lse is not None:
            verdict.lse_err, verdict.lse_bound = max_err(lse, self.lse), self.lse_bound
        return verdict
