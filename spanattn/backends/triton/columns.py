"""The columns of the per-tile schedule table (schedule.INFO) as constexprs, so that the kernels
that write and read it (schedule_triton.py, kernel.py, kernel_gluon.py) name a column instead of
counting to it."""

import triton.language as tl

from .schedule import INFO

Q_ROW0 = tl.constexpr(INFO.index("q_row0"))
Q_ROW_LAST = tl.constexpr(INFO.index("q_row_last"))
K_ROW0 = tl.constexpr(INFO.index("k_row0"))
KV_LEN = tl.constexpr(INFO.index("kv_len"))
SEQ = tl.constexpr(INFO.index("seq"))
KV_START = tl.constexpr(INFO.index("kv_start"))
KV_END = tl.constexpr(INFO.index("kv_end"))
FULL_START = tl.constexpr(INFO.index("full_start"))
FULL_END = tl.constexpr(INFO.index("full_end"))
