"""The numerics rule (spanattn.oracle) as a test assertion."""

from spanattn.oracle import Truth


def assert_close_to_truth(out, lse, q, k, v, plan, *, rounding_slack=False, **opts):
    verdict = Truth(q, k, v, plan, **opts).check(out, lse, rounding_slack=rounding_slack)
    assert verdict.ok, str(verdict)
