"""The rules on plain arguments that several entry points take (counts and positions, softmax
scales, devices), written once so that a rule and its message are the same wherever the
argument comes in. A message names the argument, its value and the rule it broke.

Counts are integers: a Python int, a numpy integer or a one-element integer tensor; a bool or a
float is refused rather than read as a number (``1.7`` is no position, ``True`` no length). The
kernels index tokens, keys and packed offsets with int32, so every length, position and total of
lengths is at most ``INT32_MAX``: a larger one is refused, never truncated. Device plans get the
same rule on the device (device_rules.py), where nothing can raise without a sync.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT32_WHY = "kernels index tokens and keys with int32"
INT32_LIMIT = f"the int32 limit ({INT32_WHY})"


def integer(
    name: str, value, minimum: int | None = None, maximum: int = INT32_MAX, limit: str = INT32_LIMIT
) -> int:
    """``value`` as a Python int in ``[minimum, maximum]``, else TypeError / ValueError naming
    ``name`` (``limit`` says what ``maximum`` is).

    >>> integer("Seq.q_len", 5, 1)
    5
    >>> integer("Seq.kv_len", 2**31, 1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Seq.kv_len = 2147483648 is over 2147483647, the int32 limit (...)
    >>> integer("Seq.kv_len", 4.0)
    Traceback (most recent call last):
    ...
    TypeError: Seq.kv_len must be an int, got 4.0 (float)
    """
    if type(value) is int and (minimum is None or value >= minimum) and value <= maximum:
        return value  # the common case, first: this runs for every length of every step
    if isinstance(value, bool) or (torch.is_tensor(value) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an int, got {value!r} (a bool)")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if number > maximum:
        raise ValueError(f"{name} = {number} is over {maximum}, {limit}")
    return number


def positive(name: str, value) -> float | None:
    """``None``, or ``value`` as a float that is finite and > 0 (a softmax scale, a softcap).

    A scale of 0 or below would turn the kernels' masked scores (``-inf``) into NaN (``-inf *
    0``) and reverse their running max; an infinite softcap is ``inf * tanh(s / inf)``, NaN.

    >>> positive("softcap", 30)
    30.0
    >>> positive("scale", 0.0)
    Traceback (most recent call last):
    ...
    ValueError: scale must be finite and > 0 (or None), got 0.0
    """
    if value is None or (type(value) is float and 0 < value < math.inf):
        return value  # the common cases, first: this runs on every attention call
    real = isinstance(value, numbers.Real) or (
        torch.is_tensor(value) and value.numel() == 1 and not value.is_complex()
    )
    if not real or isinstance(value, bool) or (torch.is_tensor(value) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be a real number (or None), got {value!r} ({type(value).__name__})")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be finite and > 0 (or None), got {number}")
    return number


def device(name: str, value) -> torch.device:
    """``value`` as a torch.device this process can use: a malformed one and a GPU that is not
    there are refused by name (torch's own errors name neither the argument nor the rule)."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} must be a torch device such as 'cpu' or 'cuda', got {value!r}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"{name} = {value!r}, but no CUDA device is available here (torch.cuda.is_available() "
                "is False); plan on 'cpu', or where the tensors are"
            )
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"{name} = {value!r}, but this process sees {count} CUDA device(s)")
    return dev


def fit_int32(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An integer tensor clamped into int32's range, and which of its entries were outside it
    (None when its dtype cannot hold one): on its device, no sync. Clamped, not wrapped, so
    that a length of ``2**32 + 3`` stays too long for any capacity instead of becoming 3."""
    info = torch.iinfo(value.dtype)
    if info.min >= INT32_MIN and info.max <= INT32_MAX:
        return value, None
    clamped = value.clamp(max(info.min, INT32_MIN), INT32_MAX)
    return clamped, clamped != value
