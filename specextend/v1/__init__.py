"""Generated gRPC stubs of wire protocol v1 (protos/specextend/v1/draft.proto).

Do not edit draft_pb2*.py: regenerate with `python -m specextend.rpc.codegen`
(grpcio-tools==1.84.0); tests/test_protos.py fails when they drift from the .proto.
"""
