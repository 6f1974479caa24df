"""The mask transformers asks for, kept in O(batch x tokens): :class:`StepMask` and the
``AttentionMaskInterface`` entry :func:`step_mask` that builds it.

transformers calls the entry once per forward and layer kind with the mask function its model
composed, the 2D padding mask and where the queries and keys sit in the cache. The function is
read into a policy (:mod:`spanattn.hf.mask_functions`), block ids into spans (maximal runs of one
block, at absolute positions), and the Plan is built once and shared by every layer of the kind.

Keys: a DynamicCache passes exactly the keys the layer keeps (a sliding layer drops old ones:
``kv_offset`` says where they start); a StaticCache passes its whole buffer, of which only the
first ``kv_end - kv_offset`` keys are filled: the rest is never attended to.

Eager forwards pack the real rows and plan on the host (:meth:`StepMask.plan`). A compiled
forward reads :attr:`StepMask.static` instead (:mod:`spanattn.hf.static`): the same step in the
cache's own layout, planned on the device when the mask is built, outside the compiled region.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import spanattn as sa

from .families import family_of
from .mask_functions import MaskRule, block_spans, is_bidirectional, read_mask_function
from .options import Options, options_of
from .static import StaticStep


class Row(NamedTuple):
    """Where one planned sequence sits in transformers' ``[B, H, S, D]`` tensors: batch row
    ``row``, queries ``q0..q1-1`` and keys ``k0..k1-1`` (indices into the step's query and key
    tensors)."""

    row: int
    q0: int
    q1: int
    k0: int
    k1: int


def _real_runs(padding, end: int, cache: bool) -> list[tuple[int, int]]:
    """``[first, stop)`` of each row's ones in ``padding[:, :end]`` (positions past the 2D mask are
    padding, as in transformers); see :meth:`StepMask.real_tokens` for what is refused."""
    pad = padding[:, :end].bool()
    if pad.shape[1] < end:
        pad = torch.nn.functional.pad(pad, (0, end - pad.shape[1]))
    count = pad.sum(1)
    first = pad.int().argmax(1)
    stop = end - pad.flip(1).int().argmax(1)
    runs = torch.stack([torch.where(count > 0, first, end), torch.where(count > 0, stop, end), count], 1)
    rows = runs.tolist()  # one device-to-host copy
    for row, (a, b, n) in enumerate(rows):
        if b - a != n:
            raise ValueError(
                f"spanattn.hf: attention_mask row {row} has padding between real tokens (positions "
                f"{a}..{b - 1} hold {n} real tokens: inner padding, or tokens after a right-padded prompt). "
                "Rows must be 0..0 1..1 (left padding, what generate() expects), or, in a forward without "
                "cache history (training, a prefill from position 0), 1..1 0..0 (right padding)"
            )
        if cache and n and b < end:
            raise ValueError(
                f"spanattn.hf: attention_mask row {row} is right-padded (real tokens end at {b}, the step at "
                f"{end}) in a step that reads or fills a cache; right padding is taken only in forwards "
                "without cache history into a DynamicCache or none (training, a prefill from position "
                "0): pad on the left to generate (tokenizer.padding_side='left')"
            )
    return [(a, b) for a, b, _ in rows]


class StepMask:
    """What attention needs from one of transformers' mask builders: the layer kind's rule, the
    2D padding mask and where keys sit (``kv_offset``: absolute position of key 0, >0 when a
    sliding cache dropped old keys; ``kv_end``: absolute end of the filled keys, which is where
    this step's queries end). Plans are cached on it, one per query/key shape and device.

    transformers code that inspects a prepared mask sees a 4D shape (``ndim``, ``shape``)."""

    ndim = 4

    def __init__(
        self,
        rule: MaskRule,
        padding,
        kv_offset: int,
        kv_length: int,
        kv_end,
        batch: int,
        q_length: int,
        options: Options,
    ):
        self.rule, self.padding, self.options = rule, padding, options
        self.kv_offset, self.kv_length = int(kv_offset), int(kv_length)
        # A StaticCache keeps the query offset on the device: kv_end stays a tensor until a host
        # plan needs it (one copy), so a compiled step never waits for the device.
        self._kv_end = kv_end if torch.is_tensor(kv_end) else int(kv_end)
        self.shape = (batch, 1, q_length, self.kv_length)
        self._static = torch.is_tensor(kv_end)  # a StaticCache: its later steps read this one's keys
        self.plans, self._real, self._spans, self._batches = {}, None, None, {}
        self.flash_checked: set = set()  # (keyword, id) of flash keywords held to this step's rows
        # what a compiled forward reads (step_mask builds it), or why it could not be built
        self.static: StaticStep | None = None
        self.static_error: Exception | None = None

    def __getitem__(self, key):
        # Gemma 4 keeps only the last query rows before its KV-shared layers
        # (mask[:, :, -n:, :]); queries always end at kv_end, so nothing changes.
        if isinstance(key, tuple) and len(key) == 4 and key[3] == slice(None) and key[2].stop is None:
            return self
        raise TypeError(f"spanattn.hf.StepMask cannot be indexed with {key!r}")

    @property
    def kv_end(self) -> int:
        """Absolute end of the filled keys, where this step's queries end (read to the host once)."""
        if torch.is_tensor(self._kv_end):
            end = int(self._kv_end)
            check_queries_among_keys(end - self.shape[2], self.kv_offset, self.kv_length, end)
            self._kv_end = end
        return self._kv_end

    def real_tokens(self) -> list[tuple[int, int]]:
        """Each row's real tokens ``[first, stop)`` among positions ``0..kv_end-1``. Rows are
        ``0..0 1..1`` (left padding), or, in a step without cache history (a training forward, a
        prefill from position 0), also ``1..1 0..0`` and ``0..0 1..1 0..0``: right padding, what
        training collators give. Raises on padding between real tokens, and on right padding
        after cached tokens or into a StaticCache (the steps after it would read the padding)."""
        if self._real is None:
            batch, end = self.shape[0], self.kv_end
            if self.padding is None:
                self._real = [(0, end)] * batch
            else:
                # cached tokens before the queries, or a StaticCache's buffer (its keys beyond `end`)
                cache = end > self.shape[2] or self._static or self.kv_length > end - self.kv_offset
                self._real = _real_runs(self.padding, end, cache)
        return self._real

    def spans(self, row: int) -> list[tuple[int, ...]]:
        """Absolute inclusive spans of batch row ``row``, ``(start, end, group)`` for the runs of a
        block made of several (span groups), all rows computed at the first call."""
        if self.rule.blocks is None or self.rule.layer.spans == "off":
            return []
        if self._spans is None:
            self._spans = block_spans(self.rule.blocks, self.shape[0])
        return self._spans.get(row, [])

    def plan(self, sq: int, sk: int, device):
        """``(plan, rows)`` for queries ``[B, H, sq, D]`` over keys ``[B, H, sk, D]``; ``rows`` holds
        a :class:`Row` per planned sequence."""
        if sk != self.kv_length:
            raise RuntimeError(f"keys ({sk}) do not match the mask's kv_length ({self.kv_length})")
        key = (sq, sk, device)
        if key not in self.plans:
            self.plans[key] = self._plan(sq, device)
        return self.plans[key]

    def _plan(self, sq: int, device):
        batch, rows = self.sequences(sq)
        return (None if batch is None else sa.plan(batch, self.rule.layer, device=device)), rows

    def sequences(self, sq: int):
        """``(batch, rows)``: the :class:`spanattn.Batch` of the real rows for ``sq`` queries
        (None if every query is padding), checked, and ``rows`` as :meth:`plan` gives them."""
        if sq not in self._batches:
            self._batches[sq] = self._sequences(sq)
        return self._batches[sq]

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(row, first, stop)``: the positions ``[first, stop)`` of each spanattn sequence, in
        order: a row's real tokens, or, in a packed row (:attr:`MaskRule.samples`), each sample."""
        real = self.real_tokens()
        if self.rule.samples is None:
            return [(row, first, stop) for row, (first, stop) in enumerate(real)]
        if self.kv_end != self.shape[2] or self.kv_offset:  # transformers packs only without a cache
            raise NotImplementedError("spanattn.hf: a packed row (samples) in a step after cached tokens")
        ids = self.rule.samples.expand(self.shape[0], -1)[:, : self.kv_end]
        change = torch.nn.functional.pad(ids[:, 1:] != ids[:, :-1], (1, 0), value=True)
        starts = change.nonzero().tolist()  # one device-to-host copy: (row, first position)
        pieces = []
        for i, (row, first) in enumerate(starts):
            nxt = starts[i + 1] if i + 1 < len(starts) else None
            stop = nxt[1] if nxt is not None and nxt[0] == row else self.kv_end
            lo, hi = max(first, real[row][0]), min(stop, real[row][1])
            if lo < hi:
                pieces.append((row, lo, hi))
        return pieces

    def _sequences(self, sq: int):
        end = self.kv_end
        first_query = end - sq  # absolute position of query 0
        seqs, rows = [], []
        for row, first, stop in self.pieces():
            base = max(first, self.kv_offset)  # absolute position of this piece's key 0
            q0, q1 = max(0, base - first_query), stop - first_query
            if q0 >= q1:
                continue  # only padding queries (or cached keys) in this piece: their output is zero
            spans = self._piece_spans(row, first, stop, base, first_query + q0)
            kv_len = stop - base
            prompt_len = max([kv_len] + [sp[1] + 1 for sp in spans])
            seqs.append(
                sa.Seq(
                    q_len=q1 - q0, kv_len=kv_len, spans=spans, causal=self.rule.causal, prompt_len=prompt_len
                )
            )
            rows.append(Row(row, q0, q1, base - self.kv_offset, stop - self.kv_offset))
        if not seqs:
            return None, rows
        try:
            batch = sa.Batch(seqs, allow_split_spans=self.options.allow_split_spans)
        except ValueError as err:  # a chunk cutting an image: say how to get transformers' behaviour
            raise ValueError(
                f"{err} (positions counted from the row's first real token). To cut the image at the "
                "chunk end as transformers does, use spanattn.hf.enable(model, allow_split_spans=True)"
            ) from None
        return batch, rows

    def _piece_spans(self, row: int, first: int, stop: int, base: int, first_query: int) -> list[tuple]:
        """The spans of row ``row`` inside the piece ``[first, stop)`` (cut at its ends: a run
        crossing into the padding or the next sample), from its key ``base`` on. A span reaching past
        the step's end is left whole (a chunk cutting an image, or a group's later images:
        :class:`spanattn.Batch` decides)."""
        end = self.kv_end
        clipped = [
            (max(s, first), e if e >= end else min(e, stop - 1), *group)
            for s, e, *group in self.spans(row)
            if e >= first and (s < stop or s >= end)
        ]
        reach = {}  # the last position of each span group: its first span's queries are there too
        for _, e, *group in clipped:
            if group:
                reach[group[0]] = max(e, reach.get(group[0], e))
        spans = []
        for s, e, *group in clipped:
            last = reach[group[0]] if group else e  # the last query that sees this span's keys
            if self.rule.layer.spans == "on" and s < base and last >= first_query:
                raise NotImplementedError(
                    f"spanattn.hf: the cache dropped keys {s}..{base - 1} of the image at "
                    f"{s}..{e} that queries of this step attend to (a sliding layer whose images ignore "
                    "the window); prefill the whole image in one step"
                )
            if e >= base:  # keys before `base` are padding or outside every query's window: clip
                spans.append((max(s, base) - base, e - base, *group))
        return spans

    @classmethod
    def every_key(cls, batch: int, sq: int, sk: int, options: Options) -> StepMask:
        """Non-causal rows that see all ``sk`` keys: a canvas its model runs without a mask."""
        rule = MaskRule(sa.LayerMask(None, "off"), causal=False)
        return cls(rule, None, 0, sk, sk, batch, sq, options)

    def __repr__(self) -> str:
        return (
            f"StepMask({self.rule.layer!r}, causal={self.rule.causal}, kv_offset={self.kv_offset}, "
            f"kv_length={self.kv_length}, kv_end={self._kv_end}, plans={len(self.plans)})"
        )


def step_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=None,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    config=None,
    **kw,
):
    """The ``AttentionMaskInterface`` entry: a :class:`StepMask` instead of a dense mask.

    A mask already prepared by spanattn (a model handing its mask to its language model) is
    returned as is. An encoder's mask (bidirectional over its own inputs, no cache: vision and
    audio towers) is transformers' SDPA mask: those layers keep SDPA.
    """
    from transformers import masking_utils

    if isinstance(attention_mask, StepMask):
        return attention_mask
    mask_function = mask_function or masking_utils.causal_mask_function
    if q_offset is None:  # older transformers pass the query positions instead
        q_offset = kw["cache_position"][0] if kw.get("cache_position") is not None else 0
    if is_bidirectional(mask_function) and q_offset == 0 and int(kv_offset) == 0:
        family = family_of(config) if config is not None else None
        why = family.refuse(config) if family is not None else None
        if why:  # a text stack configured as an encoder, not a tower
            raise NotImplementedError(f"spanattn.hf does not serve this {family.name} model: {why}")
        return masking_utils.sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            mask_function=mask_function,
            attention_mask=attention_mask,
            **kw,
        )
    rule = read_mask_function(mask_function)
    kv_end = q_offset + q_length  # a tensor (on the device) under a StaticCache
    if not torch.is_tensor(kv_end):
        check_queries_among_keys(q_offset, kv_offset, kv_length, kv_end)
    mask = StepMask(
        rule, attention_mask, kv_offset, kv_length, kv_end, batch_size, q_length, options_of(config)
    )
    try:
        mask.static = StaticStep.of(mask, kw.get("device") or _device_of(attention_mask, q_offset))
    except (ValueError, NotImplementedError) as err:  # an eager forward raises it if it plans the same
        mask.static_error = err
    return mask


def check_queries_among_keys(q_offset: int, kv_offset, kv_length: int, kv_end: int) -> None:
    if not int(kv_offset) < kv_end <= int(kv_offset) + kv_length:
        raise NotImplementedError(
            f"spanattn.hf needs this step's queries among its keys; the cache gives queries at "
            f"{q_offset}..{kv_end - 1} and keys {int(kv_offset)}..{int(kv_offset) + kv_length - 1}"
        )


def _device_of(*tensors) -> torch.device:
    return next((t.device for t in tensors if torch.is_tensor(t)), torch.device("cpu"))
