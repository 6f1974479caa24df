"""The columns of the per-tile schedule table, by name (``INFO``) and as constexpr indices, so
that the code that builds it (schedule.py, schedule_triton.py) and the kernels that read it
(kernel.py, gluon_parts.py) name a column instead of counting to it. Nothing here imports the
rest of the backend: every module that touches the table sits above this one."""

import triton.language as tl

# One row per tile: everything a program needs before its first key tile, so that it issues its
# K/V loads after one round of scalar loads (finding the sequence, then its offsets, then
# reducing its rows' intervals would be three dependent rounds: a few microseconds that one
# program per SM cannot hide).
INFO = ("q_row0", "q_row_last", "k_row0", "kv_len", "seq", "kv_start", "kv_end", "full_start", "full_end")

Q_ROW0 = tl.constexpr(INFO.index("q_row0"))
Q_ROW_LAST = tl.constexpr(INFO.index("q_row_last"))
K_ROW0 = tl.constexpr(INFO.index("k_row0"))
KV_LEN = tl.constexpr(INFO.index("kv_len"))
SEQ = tl.constexpr(INFO.index("seq"))
KV_START = tl.constexpr(INFO.index("kv_start"))
KV_END = tl.constexpr(INFO.index("kv_end"))
FULL_START = tl.constexpr(INFO.index("full_start"))
FULL_END = tl.constexpr(INFO.index("full_end"))

# The Gluon kernels' span-group walk (group_walk.py), one row per tile of the schedule, in its
# order: the key tiles a tile's grouped rows need outside its interval walk, as ``pre_tiles``
# tiles from ``pre_start`` (before ``kv_start``; never in clamp mode) and ``post_tiles`` from
# ``post_start`` (the end of the interval walk's last tile).
WALK = ("pre_start", "pre_tiles", "post_start", "post_tiles")

PRE_START = tl.constexpr(WALK.index("pre_start"))
PRE_TILES = tl.constexpr(WALK.index("pre_tiles"))
POST_START = tl.constexpr(WALK.index("post_start"))
POST_TILES = tl.constexpr(WALK.index("post_tiles"))
N_WALK = tl.constexpr(len(WALK))

# The backward's dK/dV pass (key_schedule.py, kernel_bwd.py), one row per key tile: the tile's
# sequence (its first packed key and query rows, lengths), the tile's first key in it, and its
# query walk in ``block_m``-query tiles, query indices local to the chunk: the column hull
# ``[q_start, q_end)`` of its keys with the FULL query tiles in ``[full_start, full_end)``.
KEY_INFO = ("k_row0", "kv_len", "n_start", "q_row0", "q_len", "q_start", "q_end", "full_start", "full_end")

KEY_K_ROW0 = tl.constexpr(KEY_INFO.index("k_row0"))
KEY_KV_LEN = tl.constexpr(KEY_INFO.index("kv_len"))
KEY_N_START = tl.constexpr(KEY_INFO.index("n_start"))
KEY_Q_ROW0 = tl.constexpr(KEY_INFO.index("q_row0"))
KEY_Q_LEN = tl.constexpr(KEY_INFO.index("q_len"))
KEY_Q_START = tl.constexpr(KEY_INFO.index("q_start"))
KEY_Q_END = tl.constexpr(KEY_INFO.index("q_end"))
KEY_FULL_START = tl.constexpr(KEY_INFO.index("full_start"))
KEY_FULL_END = tl.constexpr(KEY_INFO.index("full_end"))
