"""The paged KV cache: writing a step's new keys and values into it, the slots of a step, and
gathering pages back into packed K/V for backends that read only contiguous tensors.

Layout (vLLM's and FlashInfer's NHD): ``k_cache, v_cache [num_blocks, block_size, Hkv, D]``;
``block_table [num_seqs, max_blocks]`` int32 lists each sequence's blocks in key order; key
``pos`` of sequence ``r`` lives at flat slot ``block_table[r, pos // block_size] * block_size +
pos % block_size``. Every function here is vectorized on the device and reads lengths from the
plan's host-side batch, so none of them synchronizes with the GPU.
"""

from __future__ import annotations

import torch

from .arguments import integer
from .intervals import seq_ids
from .plan import Plan

BLOCK_SIZES = (16, 32, 64, 128, 256)
LAYOUT = "[num_blocks, block_size, kv_heads, head_dim]"
HEAD_MAJOR = (
    "a head-major cache [batch or num_blocks, kv_heads, tokens, head_dim] (transformers') is not this layout"
)


def check_paged(k_cache, v_cache, block_table, plan: Plan, *, names=("k_cache", "v_cache")) -> None:
    """Shapes, dtypes and devices of a paged cache and its table against the plan (host only)."""
    kn, vn = names
    for name, t in ((kn, k_cache), (vn, v_cache)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be a paged cache {LAYOUT} with a block_table, got shape {tuple(t.shape)}"
            )
        if t.device != plan.device:
            raise ValueError(f"{name} is on {t.device} but the plan is on {plan.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{kn} and {vn} must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    check_block_size(kn, k_cache)
    block_size = k_cache.shape[1]
    if not torch.is_tensor(block_table):
        raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != plan.num_seqs:
        raise ValueError(
            f"block_table must be [num_seqs={plan.num_seqs}, max_blocks], "
            f"got shape {tuple(block_table.shape)}"
        )
    if block_table.device != plan.device:
        raise ValueError(f"block_table is on {block_table.device} but the plan is on {plan.device}")
    need = -(-plan.max_seqlen_k // block_size)
    if block_table.shape[1] < need:
        worst = max(range(plan.num_seqs), key=lambda i: plan.batch.seqs[i].kv_len)
        raise ValueError(
            f"block_table has {block_table.shape[1]} blocks per sequence but sequence {worst} has kv_len "
            f"{plan.batch.seqs[worst].kv_len}, which needs {need} blocks of {block_size}"
        )


def check_block_size(name: str, cache: torch.Tensor) -> None:
    """A paged cache's block_size, read from where the layout puts it (``shape[1]``): a
    head-major cache's heads there would otherwise be read as tokens, its tokens as heads."""
    if cache.shape[1] not in BLOCK_SIZES:
        raise ValueError(
            f"{name}.shape[1] (block_size, in the paged layout {LAYOUT}) must be one of {BLOCK_SIZES}, got "
            f"{cache.shape[1]} (shape {tuple(cache.shape)}); {HEAD_MAJOR}: attention reads one as packed "
            "k, v [tokens, kv_heads, head_dim] views, without a block_table"
        )


def _positions(plan: Plan, new_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, key position) of every packed key, or of this step's new keys only."""
    if new_only:
        total, cu, seq_id = plan.total_q, plan.cu_seqlens_q, plan.query_seq_ids()
    else:
        total, cu = plan.total_k, plan.cu_seqlens_k
        seq_id = seq_ids(cu, total)
    pos = torch.arange(total, device=plan.device) - cu[seq_id].long()
    if new_only:  # the new tokens are the last q_len keys of each sequence
        pos = pos + (plan.seq_lens - plan.cu_seqlens_q.diff()).long()[seq_id]
    return seq_id, pos


def _slots(block_table, block_size: int, seq_id, pos, num_blocks: int | None = None) -> torch.Tensor:
    """Flat cache slots; with ``num_blocks`` (reads) block ids clamped into the cache, so that a bad
    table read before its check raises (page_check.py) reads a wrong block, never outside the
    cache (on CUDA an index out of range is a device assert that ends the process). Writes do
    not clamp: a clamped slot would be another sequence's."""
    ids = block_table[seq_id, pos // block_size].long()
    if num_blocks is not None:
        ids = ids.clamp(0, num_blocks - 1)
    return ids * block_size + pos % block_size


def slot_mapping(plan: Plan, block_table, block_size: int) -> torch.Tensor:
    """int64 ``[total_q]`` cache slots of this step's new tokens (the last ``q_len`` keys of each
    sequence), to pass to :func:`write_kv_cache` before attention."""
    if not isinstance(plan, Plan):  # a DevicePlan's padding rows need their own (-1) slots
        raise TypeError(
            f"slot_mapping(plan=...) takes a spanattn.Plan, got {type(plan).__name__}; "
            "a device plan has its own plan.slot_mapping(block_table, block_size)"
        )
    integer("block_size", block_size, 1)
    if block_table.dim() != 2 or block_table.shape[0] != plan.num_seqs:
        raise ValueError(
            f"block_table must be [num_seqs={plan.num_seqs}, max_blocks], got {tuple(block_table.shape)}"
        )
    if block_table.shape[1] * block_size < plan.max_seqlen_k:
        raise ValueError(
            f"block_table holds {block_table.shape[1] * block_size} keys per sequence, "
            f"the plan needs {plan.max_seqlen_k}"
        )
    return _slots(block_table.to(plan.device), block_size, *_positions(plan, new_only=True))


def key_slots(plan: Plan, block_table, block_size: int, num_blocks: int | None = None) -> torch.Tensor:
    """int64 ``[total_k]`` cache slots of every key of the step, in packed (varlen) order (block
    ids clamped into ``num_blocks`` if given, see ``_slots``)."""
    return _slots(block_table, block_size, *_positions(plan, new_only=False), num_blocks)


def to_paged(k, v, plan: Plan, block_size: int, *, fill: float = 0.0, seed: int | None = 0):
    """Packed ``k, v [total_k, Hkv, D]`` laid into a new paged cache: ``(k_cache, v_cache,
    block_table)``. Each sequence gets its blocks from a shuffled order (``seed`` None: in
    order); every slot no sequence owns (the tail of each last block, one spare block that every
    table row names after its own blocks) holds ``fill``: NaN there shows any read of it.

    >>> import torch, spanattn as sa
    >>> p = sa.plan(sa.Batch([sa.Seq(3, kv_len=20), sa.Seq(1, kv_len=5)]), sa.LayerMask())
    >>> kc, vc, bt = to_paged(torch.ones(25, 1, 8), torch.ones(25, 1, 8), p, 16)
    >>> kc.shape, bt.shape
    (torch.Size([4, 16, 1, 8]), torch.Size([2, 3]))
    """
    need = [-(-s.kv_len // block_size) for s in plan.batch.seqs]
    num_blocks = sum(need) + 1
    order = torch.arange(num_blocks)
    if seed is not None:
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    table = torch.full((len(need), max(need) + 1), int(order[-1]), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = order[used : used + n]
        used += n
    table = table.to(plan.device)
    caches = []
    for x in (k, v):
        cache = x.new_full((num_blocks, block_size, *x.shape[1:]), fill)
        cache.view(-1, *x.shape[1:])[key_slots(plan, table, block_size)] = x
        caches.append(cache)
    return caches[0], caches[1], table


def gather_kv(k_cache, v_cache, block_table, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``k, v [total_k, Hkv, D]`` (the varlen layout) copied out of the pages."""
    check_paged(k_cache, v_cache, block_table, plan)
    slots = key_slots(plan, block_table, k_cache.shape[1], k_cache.shape[0])
    flat = (-1, *k_cache.shape[2:])
    return k_cache.reshape(flat)[slots], v_cache.reshape(flat)[slots]


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, check_slots: bool | None = None) -> None:
    """Write this step's ``k, v [tokens, Hkv, D]`` into ``k_cache, v_cache [num_blocks,
    block_size, Hkv, D]`` in place, row ``t`` at flat slot ``slot_mapping[t]``; negative slots are
    skipped (padding tokens, as in vLLM).

    check_slots: verify every slot is ``< num_blocks * block_size`` and that no two tokens name
        one slot. It reads the slots on the host, a GPU sync, so the default does it except on
        CUDA while a graph is being captured.

    The caches hold pages ``[block_size, kv_heads, head_dim]`` whose tokens and heads lie one
    after another (NHD); the pages themselves may be strided (FlashInfer's ``[num_blocks, 2, ...]``
    K and V halves). Other layouts (a head-major cache viewed in this order, a strided head_dim),
    caches that share a slot and duplicate slots are refused: each would write one value over
    another.
    """
    for name, t in (
        ("k", k),
        ("v", v),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("slot_mapping", slot_mapping),
    ):
        if not torch.is_tensor(t):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but k_cache is on {k_cache.device}")
    if not (check_slots is None or isinstance(check_slots, bool)):
        raise TypeError(f"check_slots must be None, True or False, got {check_slots!r}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must be paged caches of one shape {LAYOUT}, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if t.dim() != 3 or t.shape[1:] != cache.shape[2:]:
            raise ValueError(
                f"{name} must be [tokens, kv_heads, head_dim] = [tokens, {cache.shape[2]}, {cache.shape[3]}] "
                f"to match {name}_cache {LAYOUT} = {tuple(cache.shape)}, got {tuple(t.shape)}"
                + (f"; {HEAD_MAJOR}" if t.dim() == 3 and t.shape[1] == cache.shape[1] else "")
            )
        if t.dtype != cache.dtype:
            raise TypeError(f"{name}.dtype ({t.dtype}) must match the cache's ({cache.dtype})")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_pages_layout(name, cache)
    if _share_a_slot(k_cache, v_cache):
        what = "are one tensor" if k_cache is v_cache else "share memory"
        raise ValueError(f"k_cache and v_cache {what}: every value written would overwrite a key")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must have the same tokens, got {k.shape[0]} and {v.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [tokens={k.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if check_slots is None:
        check_slots = not (k_cache.is_cuda and torch.cuda.is_current_stream_capturing())
    if check_slots and k.shape[0]:
        _check_slots(slot_mapping, k_cache.shape[0], k_cache.shape[1])
    if k_cache.is_cuda:
        from .backends.triton.cache_write import write_kv_cache_triton

        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    # Off the GPU a boolean mask costs nothing; on it, the Triton kernel skips padding without
    # a sync and without racing on a dummy slot. Indexed by (block, offset): pages may be strided.
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block, offset = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[block, offset] = k[keep]
    v_cache[block, offset] = v[keep]


def _check_pages_layout(name: str, cache: torch.Tensor) -> None:
    """Pages ``[block_size, kv_heads, head_dim]`` each in one piece (NHD), pages apart by at least
    a page: what the writers index and the kernels read (strides of size-1 dimensions are free)."""
    num_blocks, block_size, heads, dim = cache.shape
    page = (block_size * heads * dim, heads * dim, dim, 1)
    strides = cache.stride()
    inner = all(n == 1 or st == want for n, st, want in zip(cache.shape[1:], strides[1:], page[1:]))
    if inner and (num_blocks == 1 or strides[0] >= page[0]):
        return
    head_major = heads > 1 and block_size > 1 and strides[2] > strides[1]
    raise ValueError(
        f"{name} must hold pages laid out {LAYOUT}, each page's tokens and each token's heads one "
        f"after another (strides (>= {page[0]}, {page[1]}, {page[2]}, 1)), got shape "
        f"{tuple(cache.shape)} with strides {strides}"
        + ("; that is a head-major cache [num_blocks, kv_heads, block_size, head_dim]" if head_major else "")
    )


def _share_a_slot(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do two caches (laid out as ``_check_pages_layout`` asks) have a byte in common? Views of
    one buffer whose pages interleave without touching (FlashInfer's K and V halves) do not."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    size, n = a.element_size(), a.shape[0]
    start_a, start_b = a.storage_offset() * size, b.storage_offset() * size
    page, stride = a[0].numel() * size, a.stride(0) * size
    if n == 1 or b.element_size() != size or b.stride(0) != a.stride(0):  # extents decide
        end = lambda t, start: start + ((t.shape[0] - 1) * t.stride(0) + t[0].numel()) * t.element_size()
        return start_a < end(b, start_b) and start_b < end(a, start_a)
    # page i of a and page j of b overlap where |delta + (j - i) * stride| < page
    delta = start_b - start_a
    near = (-delta // stride, -delta // stride + 1)
    return any(abs(delta + m * stride) < page for m in near if -n < m < n)


def _check_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every slot inside the cache, none named twice (padding's negative slots aside): one read
    to the host for both (the sort's last entry is the largest slot)."""
    ordered = slot_mapping.sort().values
    twice = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    top, repeats = torch.stack([ordered[-1].long(), twice.sum()]).tolist()
    num_slots = num_blocks * block_size
    if top >= num_slots:
        bad = int(slot_mapping.argmax())
        raise IndexError(
            f"slot_mapping[{bad}] = {top} is out of range for a cache of "
            f"{num_blocks} blocks x {block_size} = {num_slots} slots"
        )
    if repeats:
        slot = int(ordered[1:][twice][0])
        first, second = (slot_mapping == slot).nonzero()[:2, 0].tolist()
        raise ValueError(
            f"slot_mapping[{first}] and slot_mapping[{second}] are both {slot}: slots must be distinct "
            "(two tokens written to one slot leave one of them, on the GPU in no fixed order)"
        )
