"""Where the keys of a KV tile live: rows of the packed K/V tensors, or of a paged cache through
the sequence's ``block_table`` row. Used by the prefill kernel (kernel.py)."""

import triton
import triton.language as tl


@triton.jit
def tile_pages(BT, last_page, n, kv_end, offs_n, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block_table entries (``BT`` = this sequence's row) of the KV tile starting at ``n``,
    clamped into ``[0, last_page]``: a bad table, run before its check is seen (page_check.py),
    reads a wrong page of the cache, never outside it.
    Tiles start at multiples of BLOCK_N (see ``kv_start``), so when BLOCK_N divides PAGE_SIZE a
    tile lies in one page: one scalar. Smaller pages: one entry per key row. Positions clamp to
    ``kv_end - 1``, like the rows, so the entry read is always the sequence's own, also when
    ``_walk`` prefetches past its last tile."""
    if PAGE_SIZE >= BLOCK_N:
        page = tl.load(BT + tl.minimum(n, kv_end - 1) // PAGE_SIZE)
    else:
        page = tl.load(BT + tl.minimum(n + offs_n, kv_end - 1) // PAGE_SIZE)
    return tl.minimum(tl.maximum(page, 0), last_page)


@triton.jit
def kv_rows(
    page, n, kv_end, k_row0, offs_n, MASKED: tl.constexpr, PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Physical rows (int64) in the K/V tensors of the KV tile starting at ``n``. PARTIAL tiles
    clamp positions to ``kv_end - 1`` (the address, not the mask): every load stays in bounds
    without load masks and reads a real, finite key. Rows past kv_end get p = 0, but 0 * NaN
    (a paged cache's unused slots) would still reach acc."""
    if PAGED and PAGE_SIZE >= BLOCK_N:
        # One page: a scalar base plus in-page offsets, so FULL tiles are scalar + arange, as
        # contiguous as the packed path. The same rows as the general form: the clamped
        # position stays in [n, n + BLOCK_N), inside n's page.
        if MASKED != 0:
            offs = tl.minimum(offs_n, kv_end - 1 - n)
        else:
            offs = offs_n
        rows = (page.to(tl.int64) * PAGE_SIZE + n % PAGE_SIZE) + offs
    else:
        if MASKED != 0:
            pos = tl.minimum(n + offs_n, kv_end - 1)
        else:
            pos = n + offs_n
        if PAGED:
            rows = page.to(tl.int64) * PAGE_SIZE + (pos % PAGE_SIZE)
        else:
            rows = k_row0 + pos.to(tl.int64)
    return rows
