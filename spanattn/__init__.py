"""spanattn: attention for LLM serving with causal text, sliding windows, bidirectional
multimodal spans and per-sequence causal flags in one batch."""

from .api import attention
from .plan import Plan, plan
from .spans import drop_wide_spans, max_chunk_end, spans_from_placeholders, spans_from_token_types
from .spec import Batch, LayerMask, Seq

__all__ = [
    "Batch",
    "LayerMask",
    "Plan",
    "Seq",
    "attention",
    "drop_wide_spans",
    "max_chunk_end",
    "plan",
    "spans_from_placeholders",
    "spans_from_token_types",
]
