"""transformers integration: a model's attention computed by spanattn, no dense mask built.

    import spanattn.hf
    spanattn.hf.enable(model)          # Gemma 3 / Gemma 4 (vision) or any plain causal decoder

How it plugs in (transformers >= 5):
- ``AttentionMaskInterface``: mask creation returns a :class:`StepMask` (the 2D padding mask and
  the KV offsets of the cache, O(batch x tokens)) instead of an O(q x kv) tensor. It is built
  once per forward and layer kind, so the Plan cached on it is shared by every layer of that kind.
- ``AttentionInterface``: packs ``[B, H, S, D]`` into varlen ``[tokens, H, D]`` (padding dropped),
  plans ``Seq(q_len, kv_len, spans)`` per row and calls :func:`spanattn.attention`.
- Forward hooks on the modules that take ``token_type_ids`` / ``mm_token_type_ids`` capture them:
  spans are maximal runs of vision tokens, at absolute positions (transformers' convention).

Supported: forward passes, ``generate()`` with the default ``DynamicCache`` (sliding layers keep
the last ``W - 1`` keys: the mask's ``kv_offset`` says where they start, and no clamp/causal query
needs older ones), left padding (rows ``0..0 1..1``; what ``generate`` uses). Raised: right or
inner padding, static caches, bidirectional (non-causal) models, attention dropout, 4D masks.
"""

from __future__ import annotations

import inspect

import torch

import spanattn as sa

NAME = "spanattn"


def layer_mask(config, window: int | None) -> sa.LayerMask:
    """The policy of a layer with sliding ``window`` (None: global) for this text config."""
    kind = getattr(config, "model_type", "") or ""
    bidir = getattr(config, "use_bidirectional_attention", None)
    if kind.startswith("gemma3"):
        if bidir:
            raise NotImplementedError("spanattn.hf: Gemma 3 with use_bidirectional_attention is not causal")
        return sa.LayerMask(window, "clamp") if window else sa.LayerMask(None, "on")
    if kind.startswith("gemma4"):
        if bidir not in (None, "vision"):
            raise NotImplementedError(f"spanattn.hf: Gemma 4 with use_bidirectional_attention={bidir!r}")
        return sa.LayerMask(window, "clamp" if bidir and window else "off")
    return sa.LayerMask(window, "off")


def span_source(config) -> tuple[str, tuple[int, ...]] | None:
    """(forward argument, vision token types) that carry spans for this text config, if any."""
    kind = getattr(config, "model_type", "") or ""
    if kind.startswith("gemma3"):
        return "token_type_ids", (1,)
    if kind.startswith("gemma4") and getattr(config, "use_bidirectional_attention", None) == "vision":
        return "mm_token_type_ids", (1, 2)
    return None


class _State:
    """Per enabled model: options, and the token types of the forward in flight."""

    def __init__(self, config, backend: str, allow_split_spans: bool):
        self.config, self.backend, self.allow_split_spans = config, backend, allow_split_spans
        self.source = span_source(config)
        self.token_types, self._spans = None, {}
        self.hooks, self.previous = [], None

    def set_token_types(self, types) -> None:
        self.token_types, self._spans = types, {}

    def spans(self, row: int) -> list[tuple[int, int]]:
        """Absolute inclusive spans of batch row ``row`` (computed once per forward)."""
        if self.token_types is None or self.source is None:
            return []
        if row not in self._spans:
            ids = torch.as_tensor(self.token_types)
            self._spans[row] = sa.spans_from_token_types(ids[row].cpu(), self.source[1])
        return self._spans[row]


class StepMask:
    """What attention needs from transformers' mask builder for one forward and layer kind:
    the 2D padding mask and where the KV states sit (``kv_offset``: absolute position of the
    first key, >0 when a sliding cache dropped old keys). Plans are cached on it."""

    def __init__(self, padding, kv_offset: int, kv_length: int):
        self.padding, self.kv_offset, self.kv_length = padding, int(kv_offset), int(kv_length)
        self.plans = {}

    def __getitem__(self, key):
        # Gemma 4 keeps only the last query rows before its KV-shared layers
        # (mask[:, :, -n:, :]); queries are always the trailing keys, so nothing changes.
        if isinstance(key, tuple) and len(key) == 4 and key[3] == slice(None) and key[2].stop is None:
            return self
        raise TypeError(f"spanattn.hf.StepMask cannot be indexed with {key!r}")

    def left_pads(self, batch: int, kv_end: int) -> list[int]:
        """Padding tokens at the start of each row; raises unless every row is ``0..0 1..1``."""
        if self.padding is None:
            return [0] * batch
        pad = self.padding[:, :kv_end].bool()
        if pad.shape[1] < kv_end:  # like transformers: positions past the 2D mask are masked
            pad = torch.nn.functional.pad(pad, (0, kv_end - pad.shape[1]))
        if pad.shape[1] > 1 and not bool((pad[:, 1:].int() >= pad[:, :-1].int()).all()):
            raise ValueError(
                "spanattn.hf supports left padding only: every attention_mask row must be 0..0 1..1 "
                "(tokenizer.padding_side='left', what generate() expects); got padding after a real token"
            )
        return (kv_end - pad.sum(1)).tolist()

    def __repr__(self) -> str:
        return f"StepMask(kv_offset={self.kv_offset}, kv_length={self.kv_length}, plans={len(self.plans)})"


def step_mask(batch_size, kv_length, kv_offset=0, attention_mask=None, q_length=None, q_offset=None, **kw):
    """The ``AttentionMaskInterface`` entry: returns a :class:`StepMask`, never a dense mask."""
    cache_position = kw.get("cache_position")
    if q_offset is None and cache_position is not None:  # older transformers pass positions
        q_offset, q_length = cache_position[0], cache_position.shape[0]
    if q_offset is not None and q_length is not None and int(q_offset) + q_length != kv_offset + kv_length:
        raise NotImplementedError(
            f"spanattn.hf needs the queries to be the last keys (DynamicCache or no cache); this cache "
            f"gives queries at {int(q_offset)}.. and keys {kv_offset}..{kv_offset + kv_length - 1}"
        )
    return StepMask(attention_mask, kv_offset, kv_length)


def _plan(step: StepMask, state: _State, layer: sa.LayerMask, b: int, sq: int, sk: int, device):
    """Plan and per-row ``(batch row, first real query, first real key)`` of this step."""
    kv_end = step.kv_offset + sk  # absolute end of the keys
    if layer.spans == "on" and step.kv_offset > 0:
        raise NotImplementedError("spanattn.hf: spans 'on' need every key, but the cache dropped some")
    seqs, rows = [], []
    for row, pads in enumerate(step.left_pads(b, kv_end)):
        base = max(pads, step.kv_offset)  # absolute position of this row's key 0
        q0 = max(0, base - (kv_end - sq))
        if q0 >= sq:
            continue  # only padding queries in this row: their output is zero
        spans = []
        for s, e in state.spans(row) if layer.spans != "off" else ():
            # Keys before `base` are padding or outside every query's window (clamp): clip.
            if e >= base:
                spans.append((max(s, base) - base, e - base))
        prompt_len = max([kv_end - base] + [e + 1 for _, e in spans])
        seqs.append(sa.Seq(q_len=sq - q0, kv_len=kv_end - base, spans=spans, prompt_len=prompt_len))
        rows.append((row, q0, base - step.kv_offset))
    if not seqs:
        return None, rows
    try:
        batch = sa.Batch(seqs, allow_split_spans=state.allow_split_spans)
    except ValueError as err:  # a chunk cutting an image: say how to get transformers' behaviour
        raise ValueError(
            f"{err} (positions counted from the row's first real token). To cut the image at the "
            "chunk end as transformers does, use spanattn.hf.enable(model, allow_split_spans=True)"
        ) from None
    return sa.plan(batch, layer, device=device), rows


def _pack(x: torch.Tensor, rows, dense: bool, col: int) -> torch.Tensor:
    """``[B, H, S, D]`` to varlen ``[tokens, H, D]`` keeping each row from its first real token."""
    b, h, s, d = x.shape
    if dense and b == 1:  # a strided view, no copy: backends take any token/head strides
        return x[0].transpose(0, 1)
    if dense:
        return x.transpose(1, 2).reshape(b * s, h, d)
    return torch.cat([x[r[0], :, r[col] :].transpose(0, 1) for r in rows])


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``AttentionInterface`` entry: same contract as transformers' eager attention, returns
    ``(out [B, S, Hq, D], None)``."""
    state = getattr(module, "_spanattn_state", None)
    if state is None:
        raise RuntimeError(f"attn_implementation={NAME!r} needs spanattn.hf.enable(model) first")
    if not isinstance(attention_mask, StepMask):
        raise TypeError(
            f"spanattn.hf builds its own mask from the 2D attention_mask; got {type(attention_mask).__name__}"
        )
    if dropout and module.training:
        raise NotImplementedError("spanattn.hf has no attention dropout")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("spanattn.hf supports causal attention layers only")
    b, _, sq, _ = query.shape
    sk = key.shape[2]
    if sk != attention_mask.kv_length:
        raise RuntimeError(f"keys ({sk}) do not match the mask's kv_length ({attention_mask.kv_length})")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    layer = layer_mask(state.config, window)
    cache_key = (layer, sq, sk, query.device)
    if cache_key not in attention_mask.plans:
        attention_mask.plans[cache_key] = _plan(attention_mask, state, layer, b, sq, sk, query.device)
    plan, rows = attention_mask.plans[cache_key]
    out = query.new_zeros(b, sq, query.shape[1], value.shape[3])
    if plan is None:
        return out, None
    dense = len(rows) == b and all(q0 == 0 and k0 == 0 for _, q0, k0 in rows)
    q, k, v = _pack(query, rows, dense, 1), _pack(key, rows, dense, 2), _pack(value, rows, dense, 2)
    o = sa.attention(q, k, v, plan, backend=state.backend, scale=scaling, softcap=kwargs.get("softcap"))
    if dense:
        return o.view(b, sq, *o.shape[1:]), None
    cu = plan.cu_seqlens_q.tolist()
    for i, (row, q0, _) in enumerate(rows):
        out[row, q0:] = o[cu[i] : cu[i + 1]]
    return out, None


def register() -> None:
    """Register ``attn_implementation="spanattn"`` with transformers (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, step_mask)


def enable(model, *, backend: str = "auto", allow_split_spans: bool = False):
    """Make ``model``'s text attention run through spanattn; the vision tower keeps its own.

    backend: passed to :func:`spanattn.attention` (``"auto"``: triton on CUDA when available).
    allow_split_spans: a forward whose last key falls inside an image proceeds with the image
        cut there (transformers' behaviour) instead of raising.
    Calling it again replaces the options; :func:`disable` undoes it. Returns the model.
    """
    register()
    config = model.config.get_text_config()
    layer_mask(config, None)  # raises now for unsupported policies
    if not getattr(config, "is_causal", True):
        raise NotImplementedError("spanattn.hf supports causal decoders only")
    old = getattr(model, "_spanattn_state", None)
    previous = old.previous if old else config._attn_implementation
    disable(model)
    state = _State(config, backend, allow_split_spans)
    state.previous = previous
    for m in model.modules():
        m._spanattn_state = state
    config._attn_implementation = NAME
    arg = state.source[0] if state.source else None
    for m in model.modules():
        params = list(inspect.signature(m.forward).parameters) if arg else []
        if arg in params:
            state.hooks.append(
                m.register_forward_pre_hook(_capture(state, arg, params.index(arg)), with_kwargs=True)
            )
            state.hooks.append(
                m.register_forward_hook(lambda *_: state.set_token_types(None), always_call=True)
            )
    return model


def disable(model):
    """Undo :func:`enable`: hooks removed, the previous attention implementation back."""
    state = getattr(model, "_spanattn_state", None)
    if state is None:
        return model
    for handle in state.hooks:
        handle.remove()
    for m in model.modules():
        m.__dict__.pop("_spanattn_state", None)
    state.config._attn_implementation = state.previous
    return model


def _capture(state: _State, arg: str, index: int):
    def hook(module, args, kwargs):
        types = kwargs[arg] if arg in kwargs else (args[index] if len(args) > index else None)
        state.set_token_types(types)

    return hook
