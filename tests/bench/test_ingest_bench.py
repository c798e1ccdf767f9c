"""`bench/ingest.py` sends exports the collector decodes whole: every span, its attribute types, ids and events."""

from __future__ import annotations

from art_langgraph import semconv as sc
from bench.ingest import SPANS_PER_TRACE, make_exports
from collector.otlp import CONTENT_TYPE_PROTOBUF, decode_request


def test_ingest_exports_decode_to_every_span_with_typed_attributes() -> None:
    bodies = make_exports(traces=5, per_export=2)
    decoded = [decode_request(body, CONTENT_TYPE_PROTOBUF) for body in bodies]
    assert len(bodies) == 3 and not any(d.rejected for d in decoded)
    spans = [span for d in decoded for span in d.spans]
    assert len(spans) == 5 * SPANS_PER_TRACE
    roots = [s for s in spans if s.parent_span_id is None]
    assert len(roots) == 5 and len({s.trace_id for s in spans}) == 5
    assert all(s.parent_span_id == next(r.span_id for r in roots if r.trace_id == s.trace_id)
               for s in spans if s.parent_span_id is not None)
    root = roots[0]
    assert root.attributes[sc.GROUP_SIZE] == 4 and root.resource["service.name"] == "bench-agent"
    reward = root.events[0]
    assert reward.name == sc.REWARD_EVENT and isinstance(reward.attributes[sc.REWARD_VALUE], float)
    llm = next(s for s in spans if s.attributes[sc.SPAN_KIND] == sc.SPAN_KIND_LLM)
    completion = llm.attributes[sc.COMPLETION_TOKEN_IDS]
    assert len(completion) == 75 and all(isinstance(t, int) for t in completion)
    assert all(isinstance(lp, float) and lp <= 0 for lp in llm.attributes[sc.COMPLETION_LOGPROBS])
    assert llm.attributes[sc.POLICY_STEP] == 0 and llm.attributes[sc.GEN_AI_USAGE_INPUT_TOKENS] == 250
