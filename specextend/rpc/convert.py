"""The one place where the draft interface's objects and the wire protocol's messages meet.

DraftConfig's fields are the configuration's flat names (config.py); a value out of range
raises pydantic's ValidationError (a ValueError), which the server maps to INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import Optional

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams, DraftTree, Outcomes, Retrieval, TreeBound
from specextend.v1 import draft_pb2 as pb


def params_to_proto(params: DraftSessionParams) -> pb.DraftConfig:
    tree, r = params.tree, params.retrieval
    return pb.DraftConfig(
        tree_nodes=tree.nodes, tree_depth=tree.depth, tree_topk=tree.topk,
        retrieval_enabled=bool(r.enabled), retrieval_chunk_size=r.chunk_size, retrieval_top_k=r.top_k,
        retrieval_every=r.every, retrieval_sink_chunks=r.sink_chunks, retrieval_recent_chunks=r.recent_chunks,
        draft_prefill_window=r.draft_prefill_window or 0, max_new_tokens=params.max_new_tokens,
        lookup_tokens=params.lookup_tokens)


def params_from_proto(c: pb.DraftConfig) -> DraftSessionParams:
    return DraftSessionParams(
        tree=TreeConfig(nodes=c.tree_nodes, depth=c.tree_depth, topk=c.tree_topk),
        retrieval=RetrievalConfig(
            enabled=c.retrieval_enabled, chunk_size=c.retrieval_chunk_size, top_k=c.retrieval_top_k,
            every=c.retrieval_every, sink_chunks=c.retrieval_sink_chunks,
            recent_chunks=c.retrieval_recent_chunks, draft_prefill_window=c.draft_prefill_window),
        max_new_tokens=c.max_new_tokens, lookup_tokens=c.lookup_tokens)


def _us(seconds: float) -> int:
    return min(max(0, round(seconds * 1e6)), 2**32 - 1)


def tree_to_proto(tree: DraftTree) -> pb.DraftTree:
    return pb.DraftTree(step=tree.step, tokens=tree.tokens, parents=tree.parents,
                        draft_cache_tokens=tree.draft_cache_tokens, ready=tree.ready,
                        ahead_depth=tree.ahead_depth, server_us=_us(tree.server_s), queued_us=_us(tree.queued_s),
                        flight_us=_us(tree.flight_s))


def tree_from_proto(tree: pb.DraftTree) -> DraftTree:
    return DraftTree(step=tree.step, tokens=tuple(tree.tokens), parents=tuple(tree.parents),
                     draft_cache_tokens=tree.draft_cache_tokens, ready=tree.ready,
                     ahead_depth=tree.ahead_depth, server_s=tree.server_us / 1e6, queued_s=tree.queued_us / 1e6,
                     flight_s=tree.flight_us / 1e6)


def outcomes_to_proto(outs: Outcomes) -> pb.Outcomes:
    return pb.Outcomes(step=outs.step, outcomes=[pb.Outcome(verdict=v, tree=tree_to_proto(t)) for v, t in outs.trees],
                       server_us=_us(outs.server_s), queued_us=_us(outs.queued_s))


def outcomes_from_proto(outs: pb.Outcomes) -> Outcomes:
    return Outcomes(outs.step, tuple((tuple(o.verdict), tree_from_proto(o.tree)) for o in outs.outcomes),
                    server_s=outs.server_us / 1e6, queued_s=outs.queued_us / 1e6)


def prepare_to_proto(session_id: str, step: int, accepted_tokens, retrieval: Optional[Retrieval],
                     due_s: float) -> pb.StepRequest:
    request = step_to_proto(session_id, step, accepted_tokens, retrieval)
    request.prepare, request.prepare_due_us = True, _us(due_s)
    return request


def step_to_proto(session_id: str, step: int, accepted_tokens, retrieval: Optional[Retrieval],
                  bound: Optional[TreeBound] = None) -> pb.StepRequest:
    bound = bound or TreeBound()  # 0 on the wire: the session's own setting (what older clients send)
    request = pb.StepRequest(session_id=session_id, step=step, accepted_tokens=accepted_tokens,
                             max_nodes=bound.nodes, max_depth=bound.depth, ready_only=bound.ready_only)
    if retrieval is not None:  # present even with no chunk ids: "keep none but sink/recent"
        request.retrieval.SetInParent()
        request.retrieval.chunk_ids.extend(retrieval.chunk_ids)  # [K]
        request.retrieval.chunk_size = retrieval.chunk_size
    return request


def bound_from_proto(request: pb.StepRequest) -> Optional[TreeBound]:
    if not (request.max_nodes or request.max_depth or request.ready_only):
        return None
    return TreeBound(request.max_nodes, request.max_depth, request.ready_only)


def retrieval_from_proto(request: pb.StepRequest) -> Optional[Retrieval]:
    if not request.HasField("retrieval"):
        return None
    return Retrieval(tuple(request.retrieval.chunk_ids), request.retrieval.chunk_size)
