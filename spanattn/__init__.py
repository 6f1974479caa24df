"""spanattn: attention for LLM serving with causal text, sliding windows, bidirectional
multimodal spans and per-sequence causal flags in one batch."""

from .api import attention
from .device_plan import DevicePlan
from .device_planner import DevicePlanner
from .merge import merge_attention_states
from .ops import write_kv_cache
from .page_check import check_pending_pages
from .plan import Plan, plan
from .spans import drop_wide_spans, max_chunk_end, spans_from_placeholders, spans_from_token_types
from .spec import Batch, LayerMask, Seq

__all__ = [
    "Batch",
    "DevicePlan",
    "DevicePlanner",
    "LayerMask",
    "Plan",
    "Seq",
    "attention",
    "check_pending_pages",
    "drop_wide_spans",
    "max_chunk_end",
    "merge_attention_states",
    "plan",
    "spans_from_placeholders",
    "spans_from_token_types",
    "write_kv_cache",
]
