"""The committed generated code is exactly what grpcio-tools makes from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_regenerating_the_proto_code_gives_the_committed_files(tmp_path):
    protos = sorted(PROTO_ROOT.glob("lorafleet/v1/*.proto"))
    assert protos, "no .proto files found"
    # The same command as scripts/gen-proto.sh, into a scratch directory.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(PROTO_ROOT),
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *map(str, protos),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    for proto in protos:
        for suffix in GENERATED_SUFFIXES:
            relative = proto.relative_to(PROTO_ROOT).with_name(proto.stem + suffix)
            fresh = (tmp_path / relative).read_bytes()
            committed = (PROTO_ROOT / relative).read_bytes()
            assert fresh == committed, f"{relative} is stale: run scripts/gen-proto.sh"
    stray = {p.relative_to(PROTO_ROOT) for s in GENERATED_SUFFIXES for p in PROTO_ROOT.glob(f"lorafleet/v1/*{s}")}
    expected = {p.relative_to(PROTO_ROOT).with_name(p.stem + s) for p in protos for s in GENERATED_SUFFIXES}
    assert stray == expected, "generated files without a .proto"


def test_the_generated_service_matches_the_servicer():
    from lorafleet.v1 import agent_pb2
    from node_agent.server import NodeAgentServicer

    methods = [m.name for m in agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"].methods]
    assert methods == [
        "Describe",
        "LoadAdapter",
        "LoadAdapters",
        "UnloadAdapter",
        "ListAdapters",
        "Forward",
        "Generate",
        "ProveIdentity",
        "AdapterStats",
        "ResolveSource",
    ]
    assert all(m in NodeAgentServicer.__dict__ for m in methods), "every RPC is implemented by the servicer"
