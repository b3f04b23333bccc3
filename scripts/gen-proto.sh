#!/usr/bin/env bash
# Regenerate the committed Python code for proto/lorafleet/v1/*.proto (grpcio-tools).
# The generated modules live beside the .proto files, importable as `lorafleet.v1.*`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bootstrap.sh
python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto --grpc_python_out=proto proto/lorafleet/v1/*.proto
echo "generated: $(ls proto/lorafleet/v1/*_pb2*.py* | tr '\n' ' ')"
