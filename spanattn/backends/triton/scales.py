"""The two numbers every kernel of this backend takes for its scores (kernel.py, the Gluon
kernels, decode.py), written once: scores in log2 units (the kernels' softmax uses ``exp2``),
and with a softcap the score divided by it before its tanh, the tanh scaled back in log2 units.
"""

LOG2E = 1.4426950408889634


def kernel_scales(scale: float, softcap) -> tuple[float, float]:
    """``(qk_scale, softcap_log2)`` for a softmax scale and an optional softcap (the second is
    unused without one).

    >>> kernel_scales(0.5, None)[0] == 0.5 * LOG2E
    True
    """
    if softcap:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 1.0
