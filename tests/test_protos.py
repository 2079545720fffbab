"""The committed stubs (specextend/v1/draft_pb2*.py) are exactly what protoc makes of the .proto."""

from importlib.metadata import version

import pytest

pytest.importorskip(
    "grpc_tools", reason="grpcio-tools is not installed (dev extra): stubs not checked"
)

from specextend.rpc.codegen import GRPCIO_TOOLS_VERSION, REPO_ROOT, STUBS, generate  # noqa: E402


def test_stubs_match_proto(tmp_path):
    assert version("grpcio-tools") == GRPCIO_TOOLS_VERSION, (
        f"stubs must be generated with grpcio-tools=={GRPCIO_TOOLS_VERSION} (newer stubs do not "
        f"load with the GPU machines' grpcio), found {version('grpcio-tools')}"
    )
    for generated, stub in zip(generate(tmp_path), STUBS):
        assert generated.read_text() == (REPO_ROOT / stub).read_text(), (
            f"{stub} differs from protos/: regenerate with `python -m specextend.rpc.codegen`"
        )


def test_stubs_load_and_pin_grpc():
    from specextend.v1 import draft_pb2, draft_pb2_grpc

    assert draft_pb2_grpc.GRPC_GENERATED_VERSION == GRPCIO_TOOLS_VERSION
    service = draft_pb2.DESCRIPTOR.services_by_name["DraftService"]
    assert draft_pb2.DESCRIPTOR.package == "specextend.v1"
    assert [m.name for m in service.methods] == ["OpenSession", "Step", "StepStream", "CloseSession", "Health"]
