"""s3:// and oci:// sources through the operator: ``kubectl apply`` → Ready with per-rank truth, on
the real control plane, with a real agent reading a real S3 store (versitygw) and a real OCI
registry (distribution's, artifacts pushed by the real ``oras``).

The fleet's ``spec.sources.allow`` admits a bucket prefix and a registry's repository prefix (the
rule the agents apply: `lorafleet_common.storage`); the agent is the fleet owner's, with its S3
endpoint, its keys in its environment and the same prefixes in ``--allow-source``. A source
outside the fleet's prefixes is Pending ``SourceNotAllowed`` and never sent to the agent.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lorafleet_dev.agents import AgentProcess, AgentSpec
from lorafleet_dev.storage_servers import RegistryServer, S3Keys, S3Server, start_registry, start_s3_server
from lorafleet_dev.synthetic import write_model
from tests.kube.harness import ControlPlane
from tests.operator.agents import BASE_MODEL, SHAPE, adapter_manifest, add_agent_pod, apply, fleet_manifest, make_adapter, registry, status
from tests.operator.conftest import OperatorProcess, wait_for

KEYS = S3Keys("LORAFLEETE2EKEY", "e2e-s3cr3t-never-shown")
BUCKET = "adapters"


@dataclass(frozen=True)
class Stores:
    """The module's S3 store, registry, and the agent that reads them."""

    s3: S3Server
    oci: RegistryServer
    agent: AgentProcess
    work: Path


def storage_agent_spec(
    root: Path, s3: S3Server, oci: RegistryServer, tp: int, *extra: str, env: tuple[tuple[str, str], ...] = ()
) -> AgentSpec:
    """An agent of the tiny model reading this store and registry: the store's endpoint, the
    ``team`` prefixes of the bucket and the registry, the registry over plain HTTP, loopback
    allowed; `extra` arguments and `env` besides."""
    return AgentSpec(
        model_dir=write_model(root / "model", SHAPE),
        adapter_roots=(),
        base_model_name=BASE_MODEL,
        tp=tp,
        dp=1,
        max_loaded_loras=8,
        extra_args=(
            *("--cache-dir", str(root / "cache"), "--s3-endpoint", s3.endpoint),
            *("--allow-source", f"s3://{BUCKET}/team", "--allow-source", f"oci://{oci.address}/team"),
            *("--oci-plain-http", oci.address, "--allow-source-network", "127.0.0.0/8", *extra),
        ),
        env=env,
    )


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stores]:
    root = tmp_path_factory.mktemp("storage-e2e")
    s3 = start_s3_server(root / "s3", KEYS)
    oci = start_registry(root / "registry")
    agent = None
    try:
        s3.create_bucket(BUCKET)
        env = (("AWS_ACCESS_KEY_ID", KEYS.access_key_id), ("AWS_SECRET_ACCESS_KEY", KEYS.secret_access_key))
        agent = AgentProcess("storage-agent", storage_agent_spec(root, s3, oci, 2, env=env), root / "logs")
        agent.start().wait_ready()
        yield Stores(s3, oci, agent, root)
    finally:
        if agent is not None:
            agent.stop()
        oci.stop()
        s3.stop()


def ready(cluster: ControlPlane, ns: str, name: str, operator: OperatorProcess) -> dict[str, object]:
    wait_for(lambda: status(cluster, ns, name).get("phase") == "Ready", 120, f"{name} Ready", operator)
    return status(cluster, ns, name)


def test_s3_and_oci_sources_go_ready_on_every_rank_and_others_are_not_allowed(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    stores: Stores,
    operator: OperatorProcess,
) -> None:
    ns = kube_namespace
    add_agent_pod(kube_cluster, ns, stores.agent)
    fleet = fleet_manifest()
    fleet["spec"]["sources"] = {"allow": [f"s3://{BUCKET}/team", f"oci://{stores.oci.address}/team"]}
    apply(kube_cluster, ns, fleet)

    stores.s3.put_adapter(BUCKET, f"team/{ns}/from-s3", make_adapter(stores.work / "a", "from-s3", seed=1))
    digest = stores.oci.push_adapter(f"team/{ns}-lora", "v1", make_adapter(stores.work / "b", "from-oci", seed=2))
    from_s3 = adapter_manifest("from-s3", Path("/unused"))
    from_s3["spec"]["source"] = {"uri": f"s3://{BUCKET}/team/{ns}/from-s3"}
    from_oci = adapter_manifest("from-oci", Path("/unused"))
    from_oci["spec"]["source"] = {"uri": f"oci://{stores.oci.address}/team/{ns}-lora:v1"}
    elsewhere = adapter_manifest("elsewhere", Path("/unused"))
    elsewhere["spec"]["source"] = {"uri": f"s3://{BUCKET}/other/{ns}/x"}
    apply(kube_cluster, ns, from_s3, from_oci, elsewhere)

    for name in ("from-s3", "from-oci"):
        st = ready(kube_cluster, ns, name, operator)
        assert (st["agentsSummary"], st["ranksSummary"]) == ("1/1", "2/2"), st
    held = registry(stores.agent, ns)
    assert held == {f"{ns}.from-s3": [0, 1], f"{ns}.from-oci": [0, 1]}, held
    assert digest.startswith("sha256:")

    wait_for(lambda: status(kube_cluster, ns, "elsewhere").get("phase") == "Pending", 60, "elsewhere Pending", operator)
    ready_condition = (status(kube_cluster, ns, "elsewhere").get("conditions") or [{}])[0]
    assert ready_condition.get("reason") == "SourceNotAllowed", ready_condition
    assert f"{ns}.elsewhere" not in registry(stores.agent, ns)
    assert KEYS.secret_access_key not in operator.log()
