"""The local demo's inputs: every example LoraAdapter points at an adapter the demo writes.

(The demo itself, ``bash scripts/demo.sh``, runs the whole stack; it is not repeated here.)"""

from __future__ import annotations

from pathlib import Path

import yaml

from lorafleet_dev.demo import BASE_MODEL, EXAMPLE_ADAPTER_ROOT, example_manifests, write_files
from tests.kube.harness import CHECKOUT


def test_examples_point_at_the_demo_adapters(tmp_path: Path) -> None:
    _, adapters = write_files(CHECKOUT, tmp_path)
    docs = [d for d in yaml.safe_load_all(example_manifests(CHECKOUT, adapters)) if d]
    las = [d for d in docs if d["kind"] == "LoraAdapter"]
    assert len(las) >= 2 and any(d["kind"] == "LoraFleet" for d in docs)
    for la in las:
        uri = la["spec"]["source"]["uri"]
        assert uri.startswith(f"file://{adapters}/") and EXAMPLE_ADAPTER_ROOT not in uri
        path = Path(uri.removeprefix("file://"))
        assert (path / "adapter_model.safetensors").is_file()
        assert (path / "adapter_config.json").is_file()
        assert la["spec"]["baseModel"] == BASE_MODEL
