"""DESIGN.md section 4: err(backend vs fp64) <= 2 * err(same-dtype torch reference vs fp64) + 1e-4."""

import torch

from spanattn.backends import reference


def truth_and_bound(q, k, v, plan, **opts):
    """fp64 truth and the error bound that a backend running in q's dtype must meet."""
    scale = opts.pop("scale", q.shape[-1] ** -0.5)
    truth, truth_lse = reference.forward(
        q, k, v, plan, scale=scale, return_lse=True, compute_dtype=torch.float64, **opts
    )
    same, same_lse = reference.forward(
        q, k, v, plan, scale=scale, return_lse=True, compute_dtype=q.dtype, **opts
    )
    bound = 2 * (same.double() - truth.double()).abs().max().item() + 1e-4
    lse_bound = 2 * (same_lse.double() - truth_lse.double()).abs().max().item() + 1e-4
    return truth, truth_lse, bound, lse_bound


def assert_close_to_truth(out, lse, q, k, v, plan, **opts):
    truth, truth_lse, bound, lse_bound = truth_and_bound(q, k, v, plan, **opts)
    assert not torch.isnan(out).any(), "NaN in the output"
    err = (out.double() - truth.double()).abs().max().item()
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"
    if lse is not None:
        assert not torch.isnan(lse).any(), "NaN in the LSE"
        lse_err = (lse.double() - truth_lse.double()).abs().max().item()
        assert lse_err <= lse_bound, f"LSE max error {lse_err:.3g} > bound {lse_bound:.3g}"
