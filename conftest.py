"""Set-up for every test and doctest run: without a GPU, Triton kernels run in Triton's
interpreter. The switch must be on before triton is first imported (triton decorates its own
standard library, tl.max and friends, at import), and any module may import it, so it is set
here, before collection, rather than in the test modules that need it."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
