"""gRPC data plane between the target and the draft (docs/architecture.md, "Wire protocol").

client.GrpcDraftBackend is the DraftBackend the target calls; server.DraftServicer serves any
DraftBackend (the in-process draft worker in production); errors.py maps status codes to DraftError.
"""

import importlib

# imported on first use (PEP 562), so that `specextend.rpc.auth` alone stays light: the replica
# makes its draft actor's token before it imports torch (docs/architecture.md, "Deployment")
_WHERE = {"DraftHealth": "client", "GrpcDraftBackend": "client", "DraftServerThread": "server",
          "DraftServicer": "server", "start_draft_server": "server"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"specextend.rpc.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DraftHealth",
    "DraftServerThread",
    "DraftServicer",
    "GrpcDraftBackend",
    "start_draft_server",
]
