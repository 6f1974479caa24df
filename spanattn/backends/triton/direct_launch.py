"""Launching a compiled Triton kernel without Triton's per-call lookup. ``kernel[grid](*args)``
binds and specializes every argument, builds the cache key of the compiled kernel and reads the
runtime's settings on each call: host time as long as a short step's GPU time (with the routes
kept per plan, the triton backend's host time per call went from 0.115-0.169 ms to 0.076-0.134
on the H200: benchmarks/README.md, Host time). A call site that knows its compiled kernel cannot
change between calls (the caller's cache key covers every argument property Triton specializes
on: dtypes, 16-byte alignment, integer values 1 and multiples of 16, the constexprs) keeps a
``DirectLaunch`` under that key: its first call goes through Triton (compiling if needed) and
keeps the compiled kernel, later calls hand the arguments straight to its launcher, as Triton
itself would after its lookup. Under the interpreter, with a launch hook installed (a profiler),
or on a triton older than its ``knobs`` (3.4), every call goes through Triton."""

from __future__ import annotations

import triton
from triton.runtime import driver

knobs = getattr(triton, "knobs", None)


class DirectLaunch:
    """``fn[grid](*args, **constants)`` for calls whose compiled kernel is the first call's.

    >>> launch = DirectLaunch(kernel, (programs,), dict(BLOCK=128, num_warps=4))  # doctest: +SKIP
    >>> launch(q, k, v, out, scale)  # doctest: +SKIP

    The first call compiles (or finds) the kernel, later ones launch it directly. ``args``: the
    kernel's leading parameters, positionally (their properties fixed by the caller's key);
    ``constants``: every later parameter (constexprs) by name, and launch options
    (``num_warps``, ``num_stages``).
    """

    def __init__(self, fn, grid: tuple[int, ...], constants: dict):
        self.fn, self.constants = fn, constants
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.compiled: dict[int, tuple] = {}  # device index -> (compiled kernel, trailing values)
        # The interpreter's kernels (TRITON_INTERPRET=1) have no compiled form (nor a driver).
        self.direct = knobs is not None and hasattr(fn, "params")

    def __call__(self, *args) -> None:
        if not self.direct:
            self.fn[self.grid](*args, **self.constants)
            return
        device = driver.active.get_current_device()
        hit = self.compiled.get(device)
        if hit is None or knobs.runtime.launch_enter_hook is not None:
            self._through_triton(device, args)
            return
        kernel, tail = hit
        stream = driver.active.get_current_stream(device)
        g0, g1, g2 = self.grid
        kernel.run(
            g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail
        )

    def _through_triton(self, device: int, args: tuple) -> None:
        kernel = self.fn[self.grid](*args, **self.constants)
        if not hasattr(kernel, "packed_metadata"):  # a triton whose launch returns no kernel
            return
        tail = []
        for p in self.fn.params[len(args) :]:  # the bound values after args, in signature order
            if p.name in self.constants:
                tail.append(self.constants[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                raise TypeError(f"{self.fn.__name__}: no value for parameter {p.name}")
        self.compiled[device] = (kernel, tuple(tail))
