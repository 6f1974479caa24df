"""The mask of one KV tile, written once for the prefill kernel (kernel.py) and the split-KV
decode kernel (decode.py): a row's interval, and with span groups (spanattn/groups.py) the keys
of its group."""

import triton
import triton.language as tl


@triton.jit
def tile_mask(kv_idx, lo, hi, gsel, KG, key_lo, key_end, GROUPS: tl.constexpr, CLAMP: tl.constexpr):
    """The mask of one tile (groups.py): ``lo <= k <= hi``, or with span groups the key's group
    equal to the row's ``gsel`` (the row's group, or -2 where this walk counts none of its
    group's keys), in clamp mode only from ``lo`` on. ``KG``: the sequence's key groups; keys
    outside ``[key_lo, key_end)`` count as in no group (seen already, or not read)."""
    ok = (kv_idx[None, :] >= lo[:, None]) & (kv_idx[None, :] <= hi[:, None])
    if GROUPS:
        gk = tl.load(KG + kv_idx, mask=(kv_idx >= key_lo) & (kv_idx < key_end), other=-1)
        same = gk[None, :] == gsel[:, None]
        if CLAMP:
            same = same & (kv_idx[None, :] >= lo[:, None])
        ok = ok | same
    return ok
