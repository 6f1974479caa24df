"""spanattn: attention for LLM serving with causal text, sliding windows, bidirectional
multimodal spans and per-sequence causal flags in one batch.

A step: ``Batch`` of ``Seq`` (lengths, spans, causal flag) and a ``LayerMask`` (window, span
mode) -> ``plan(...)`` (or ``DevicePlanner`` on the GPU) -> ``attention(q, k, v, plan)``;
``auto_choice`` names the backend it runs. The paged cache: ``write_kv_cache``,
``check_pending_pages``; partial results: ``merge_attention_states``; spans from an engine or
transformers: ``spans_from_placeholders``, ``spans_from_token_types``, ``drop_wide_spans``,
``max_chunk_end``. Everything else (the submodules) is the implementation. The README shows
use, docs/design.md the semantics and the kernels.
"""

from .api import attention
from .device_plan import DevicePlan
from .device_planner import DevicePlanner
from .dispatch import auto_choice
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
    "auto_choice",
    "check_pending_pages",
    "drop_wide_spans",
    "max_chunk_end",
    "merge_attention_states",
    "plan",
    "spans_from_placeholders",
    "spans_from_token_types",
    "write_kv_cache",
]
