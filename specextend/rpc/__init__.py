"""gRPC data plane between the target and the draft (docs/architecture.md, "Wire protocol").

client.GrpcDraftBackend is the DraftBackend the target calls; server.DraftServicer serves any
DraftBackend (the in-process draft worker in production); errors.py maps status codes to DraftError.
"""

from specextend.rpc.client import DraftHealth, GrpcDraftBackend
from specextend.rpc.server import DraftServerThread, DraftServicer, start_draft_server

__all__ = [
    "DraftHealth",
    "DraftServerThread",
    "DraftServicer",
    "GrpcDraftBackend",
    "start_draft_server",
]
