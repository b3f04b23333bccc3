"""The rules the operator and the agents share (lorafleet_common): one table of sources, fed to both.

The operator admits a LoraAdapter's source under its fleet's spec.sources.allow; an agent with
the same prefixes (--allow-source) must admit exactly the same sources, or the operator sends
loads that fail on every agent (or the fleet's owner is bypassed). Each row goes through the
operator's admission (`lorafleet_operator.sources.admitted`) and the agent's real entry point
(`resolve_source` with no cache directory: a source it admits fails only on the missing cache,
after every URI check, so nothing is fetched). The adapter-name limit is checked the same way
against the agent's name check and the LoraAdapter CRD's CEL rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import yaml
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from lorafleet_common.adapter_names import MAX_NAME_LENGTH
from lorafleet_common.hub import parse_hub_uri, repo_id_problem
from lorafleet_operator import names
from lorafleet_operator.sources import admitted
from node_agent.errors import InvalidRequest, SourceRefused
from node_agent.sources import DEFAULT_HUB_ENDPOINT, SourcePolicy, resolve_source
from node_agent.validation import check_adapter_name
from tests.kube.harness import CHECKOUT


@dataclass(frozen=True)
class HttpRow:
    allow: tuple[str, ...]
    uri: str
    admitted: bool


H = "https://h.example"
HTTP_TABLE = [
    HttpRow((f"{H}/org",), f"{H}/org/x", True),
    HttpRow((f"{H}/org",), f"{H}/org", True),
    HttpRow((f"{H}/org",), f"{H}/organisation/x", False),  # a longer path segment is another directory
    HttpRow((f"{H}/org/",), f"{H}/org", True),  # the files fetched are /org/adapter_config.json, ...
    HttpRow((f"{H}/org/",), f"{H}/org/", True),
    HttpRow((f"{H}/org/",), f"{H}/org/x/y/", True),
    HttpRow((H,), f"{H}/x", True),
    HttpRow((H,), H, True),
    HttpRow((H,), "https://h.example.other/x", False),  # a longer host name is another host
    HttpRow((f"{H}/",), "https://h.example.other/x", False),
    HttpRow((f"{H}/",), "https://h.example:443/x", True),  # the scheme's default port, written out
    HttpRow(("http://h.example/",), "http://h.example:80/x", True),
    HttpRow((f"{H}/",), "https://h.example:8443/x", False),
    HttpRow(("https://h.example:8443/",), f"{H}/x", False),
    HttpRow(("https://h.example:*/",), "https://h.example:8443/x", True),
    HttpRow((f"{H}/",), "http://h.example/x", False),  # another scheme
    HttpRow((f"{H}/",), "HTTPS://H.EXAMPLE/x", True),  # scheme and host are case-insensitive
    HttpRow((f"{H}/org/",), "HTTPS://h.example/other/x", False),  # an upper-case scheme is still remote
    HttpRow(("https://H.Example/ORG/",), f"{H}/org/x", False),  # paths are case-sensitive
    HttpRow((f"{H}/",), "https://user:pw@h.example/x", False),  # userinfo
    HttpRow((H,), "https://h.example@evil.example/x", False),  # userinfo that looks like the host
    HttpRow((f"{H}/org/",), f"{H}/org/../secret/x", False),  # dot segments
    HttpRow((f"{H}/org/",), f"{H}/org/./x", False),
    HttpRow((f"{H}/org/",), f"{H}/org/%2e%2e/secret", False),  # percent-encoded
    HttpRow((f"{H}/org/",), f"{H}/org/..%2fsecret", False),
    HttpRow((f"{H}/org/",), f"{H}/org/x\\..\\y", False),  # after a backslash
    HttpRow((f"{H}/org/",), f"{H}/%6Frg/x", False),  # coverage compares the path as written
    HttpRow((f"{H}/org/",), f"{H}/org%2Fx", False),
    HttpRow((f"{H}/org/",), f"{H}/org/x?rev=1", False),  # a query or fragment: not a directory URL
    HttpRow((f"{H}/org/",), f"{H}/org/x#part", False),
    HttpRow((f"{H}/org/",), f"{H}/org/x?", False),  # even an empty one
    HttpRow((), f"{H}/x", False),  # no prefix: no http(s) source
    HttpRow((f"{H}/d/adapter_config.json", f"{H}/d/adapter_model.safetensors"), f"{H}/d", True),  # each file under one
    HttpRow((f"{H}/d/adapter_config.json",), f"{H}/d", False),  # the weights under none
    HttpRow((f"{H}/a/../b",), f"{H}/b/x", False),  # an invalid prefix covers nothing
    HttpRow(("http://10.0.0.1:8080/models/",), "http://10.0.0.1:8080/models/a", True),
    HttpRow(("https://[::1]:8443/",), "https://[::1]:8443/x", True),
    HttpRow((f"{H}/",), "https://h.example:99999/x", False),  # a port out of range
]


@dataclass(frozen=True)
class HubRow:
    uri: str
    allow: str  # the fleet's hf:// prefix (the agents check their hub endpoint instead)
    parsed: tuple[str, str, str] | None  # (repository, revision, folder); None: refused
    under: bool = True  # whether `allow` names the repository


COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_TABLE = [
    HubRow("hf://org/lora", "hf://org/lora", ("org/lora", "main", "")),
    HubRow("hf://org/lora", "hf://org/", ("org/lora", "main", "")),
    HubRow("HF://org/lora", "hf://org/lora", ("org/lora", "main", "")),
    HubRow("hf://org/lora@v1.0/sub/dir", "hf://org/", ("org/lora", "v1.0", "sub/dir")),
    HubRow("hf://org/lora@refs%2Fpr%2F1", "hf://org/lora", ("org/lora", "refs/pr/1", "")),
    HubRow(f"hf://org/lora@{COMMIT}/x", "hf://org/lora", ("org/lora", COMMIT, "x")),
    HubRow("hf://org/lora@/x//y/", "hf://org/lora", ("org/lora", "main", "x/y")),
    HubRow("hf://org/lora2", "hf://org/lora", ("org/lora2", "main", ""), under=False),  # compared by name
    HubRow("hf://organisation/x", "hf://org/", ("organisation/x", "main", ""), under=False),
    HubRow("hf://org/lora/../private", "hf://org/lora", None),
    HubRow("hf://org/lora/%2e%2e/x", "hf://org/lora", None),
    HubRow("hf://org/lora/a%2Fb", "hf://org/lora", None),
    HubRow("hf://org/lora/a%5C..", "hf://org/lora", None),
    HubRow("hf://org/re..po", "hf://org/", None),
    HubRow("hf://org/lo--ra", "hf://org/", None),
    HubRow("hf://org/-lora", "hf://org/", None),
    HubRow("hf://org/lora.git", "hf://org/", None),
    HubRow("hf://org/" + "r" * 97, "hf://org/", None),
    HubRow("hf://org/lora@bad..rev", "hf://org/lora", None),
    HubRow("hf://org/lora@v1.lock", "hf://org/lora", None),
    HubRow("hf://org/lora?revision=x", "hf://org/lora", None),
    HubRow("hf://org/lora#x", "hf://org/lora", None),
    HubRow("hf://org", "hf://org/", None),
    HubRow("hf://org/", "hf://org/", None),
    HubRow("hf:org/lora", "hf://org/", None),
    HubRow("hf://user@org/lora", "hf://org/", None),
]


DIGEST = "sha256:" + "ab" * 32
REG = "oci://reg.example"
# s3:// and oci:// sources under s3:// bucket and oci:// registry prefixes: the agents read them
# and the operator admits them with the one rule they share (`lorafleet_common.storage.storage_refusal`).
STORAGE_TABLE = [
    HttpRow(("s3://bkt/team",), "s3://bkt/team/x", True),
    HttpRow(("s3://bkt/team",), "s3://bkt/team", True),
    HttpRow(("s3://bkt/team",), "s3://bkt/teams/x", False),  # a longer key segment is another prefix
    HttpRow(("s3://bkt/team/",), "s3://bkt/team/x/", True),
    HttpRow(("s3://bkt",), "s3://bkt/any/key", True),
    HttpRow(("s3://bkt",), "s3://bkt", True),  # the adapter's objects at the bucket's top
    HttpRow(("s3://bkt",), "s3://other/x", False),
    HttpRow(("s3://bkt",), "S3://bkt/x", True),  # the scheme is case-insensitive
    HttpRow(("s3://bkt/team",), "s3://bkt/team/a%20b", True),  # keys are percent-decoded
    HttpRow(("s3://bkt/team",), "s3://bkt/team/../secret", False),  # traversal in keys
    HttpRow(("s3://bkt/team",), "s3://bkt/team/%2e%2e/secret", False),
    HttpRow(("s3://bkt/team",), "s3://bkt/team/a%2F..%2Fsecret", False),
    HttpRow(("s3://bkt/team",), "s3://bkt/team/x\\..\\y", False),
    HttpRow(("s3://bkt/team",), "s3://bkt/team//x", False),  # an empty segment
    HttpRow(("s3://bkt/team",), "s3://bkt/team/x%00", False),  # a control character
    HttpRow(("s3://bkt",), "s3://minio.example:9000/bkt/x", False),  # an endpoint in the URI
    HttpRow(("s3://bkt",), "s3://user:pw@bkt/x", False),
    HttpRow(("s3://bkt",), "s3://bkt/x?versionId=1", False),
    HttpRow(("s3://bkt",), "s3://bkt/x#part", False),
    HttpRow(("s3://bkt",), "s3://BKT/x", False),  # not a bucket name
    HttpRow(("s3://bk",), "s3://bk/x", False),
    HttpRow(("s3://192.168.1.1",), "s3://192.168.1.1/x", False),
    HttpRow(("s3://bkt/a/../b",), "s3://bkt/b/x", False),  # an invalid prefix: the agent does not start
    HttpRow((), "s3://bkt/x", False),  # no prefix: no s3:// source
    HttpRow((f"{H}/",), "s3://bkt/x", False),  # an http(s) prefix covers no bucket
    HttpRow((f"{REG}/team",), f"{REG}/team/lora:v1", True),
    HttpRow((f"{REG}/team",), f"{REG}/team/lora", True),  # the tag "latest"
    HttpRow((f"{REG}/team",), f"{REG}/team/lora@{DIGEST}", True),
    HttpRow((f"{REG}/team",), f"{REG}/teams/lora", False),
    HttpRow((REG,), f"{REG}/x/y:z", True),
    HttpRow(("oci://REG.example/team",), "oci://reg.EXAMPLE/team/lora", True),  # registries are case-insensitive
    HttpRow((f"{REG}:5000/team",), f"{REG}/team/lora", False),  # another port is another registry
    HttpRow((REG,), f"{REG}:5000/team/lora", False),
    HttpRow((f"{REG}:5000",), f"{REG}:5000/team/lora", True),
    HttpRow((REG,), f"{REG}/team/../secret/x", False),  # traversal in repository names
    HttpRow((REG,), f"{REG}/team/%2e%2e/x", False),
    HttpRow((REG,), f"{REG}/team/.x", False),
    HttpRow((REG,), f"{REG}/Team/lora", False),  # repository names are lowercase
    HttpRow((REG,), f"{REG}/team/lora:", False),
    HttpRow((REG,), f"{REG}/team/lora:" + "t" * 129, False),
    HttpRow((REG,), f"{REG}/team/lora:v1@{DIGEST}", False),  # a tag and a digest
    HttpRow((REG,), f"{REG}/team/lora@sha256:abc", False),
    HttpRow((REG,), "oci://user:pw@reg.example/team/lora", False),
    HttpRow((REG,), f"{REG}/team/lora?x=1", False),
    HttpRow((REG,), f"{REG}", False),
    HttpRow((), f"{REG}/team/lora", False),
]


def agent_admits(uri: str, allow: tuple[str, ...]) -> bool:
    """Whether an agent with these --allow-source prefixes admits `uri` (nothing is fetched)."""
    try:
        # No cache directory: nothing can be fetched. An S3 endpoint: s3:// sources are read.
        policy = SourcePolicy(allowed_sources=allow, s3_endpoint="https://s3.example")
    except ValueError:
        return False  # an invalid prefix: the agent does not start
    with pytest.raises(SourceRefused) as refused:
        resolve_source(uri, None, policy)
    return refused.value.reason == "no_cache_dir"


@pytest.mark.parametrize("row", HTTP_TABLE, ids=lambda row: f"{row.allow}-{row.uri}")
def test_the_operator_and_the_agents_admit_the_same_http_sources(row: HttpRow) -> None:
    assert (agent_admits(row.uri, row.allow), admitted(row.uri, list(row.allow))) == (row.admitted, row.admitted)


@pytest.mark.parametrize("row", STORAGE_TABLE, ids=lambda row: f"{row.allow}-{row.uri}")
def test_the_operator_and_the_agents_admit_the_same_storage_sources(row: HttpRow) -> None:
    assert (agent_admits(row.uri, row.allow), admitted(row.uri, list(row.allow))) == (row.admitted, row.admitted)


@pytest.mark.parametrize("row", HUB_TABLE, ids=lambda row: row.uri)
def test_the_operator_and_the_agents_read_hf_uris_the_same_way(row: HubRow) -> None:
    # The agents fetch from their hub endpoint, which the fleet's owner allows them.
    valid = row.parsed is not None
    assert agent_admits(row.uri, (f"{DEFAULT_HUB_ENDPOINT}/",)) == valid
    assert admitted(row.uri, [row.allow]) == (valid and row.under)
    if valid:
        source = parse_hub_uri(row.uri)
        assert (source.repo_id, source.revision, source.subfolder) == row.parsed


@pytest.mark.parametrize(
    "repo_id",
    [
        "org/lora",
        "Org-1/lo_ra.v2",
        "a/b",
        "o/" + "r" * 96,
        "o/" + "r" * 97,
        "org/re..po",
        "org/lo--ra",
        "org/-lora",
        "org/lora-",
        "org/.lora",
        "org/lora.git",
        "org/lo ra",
        "org/lo@ra",
        "org/lorä",
        "a/b/c",
        "/lora",
        "org/",
    ],
)
def test_the_shared_repository_name_rule_is_huggingface_hubs(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
        hub_accepts = True
    except HFValidationError:
        hub_accepts = False
    assert (repo_id_problem(repo_id) is None) == hub_accepts


def crd_name_bound() -> int:
    crd = yaml.safe_load((CHECKOUT.crds / "lorafleet.dev_loraadapters.yaml").read_text())
    rules = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    found = re.fullmatch(r"self\.metadata\.name\.size\(\) <= (\d+)", rules[0]["rule"])
    assert found is not None, rules[0]["rule"]
    message = rules[0]["message"]
    assert f"at most {found.group(1)} characters" in message and f"at most {MAX_NAME_LENGTH} characters" in message
    assert f"up to {names.MAX_NAMESPACE}" in message
    return int(found.group(1))


def test_the_crds_name_limit_is_the_shared_one() -> None:
    """YAML cannot import the rule: the CRD's number must be the one the shared limit gives."""
    assert crd_name_bound() == names.MAX_ADAPTER_NAME == MAX_NAME_LENGTH - names.MAX_NAMESPACE - len(names.SEPARATOR)


LONGEST_NAMESPACE = "n" * names.MAX_NAMESPACE


@pytest.mark.parametrize(
    "namespace, name, agent_holds, crd_admits",
    [
        (LONGEST_NAMESPACE, "a" * names.MAX_ADAPTER_NAME, True, True),  # at the limit
        (LONGEST_NAMESPACE, "a" * (names.MAX_ADAPTER_NAME + 1), False, False),  # over it
        ("default", "a" * names.MAX_ADAPTER_NAME, True, True),
        ("default", "a" * (names.MAX_ADAPTER_NAME + 1), True, False),  # the CRD assumes the longest namespace
        ("default", "a" * (MAX_NAME_LENGTH - len("default.")), True, False),  # the agent's own limit
        ("default", "a" * (MAX_NAME_LENGTH - len("default.") + 1), False, False),
        ("default", "lora-1.v2_b", True, True),
    ],
)
def test_names_at_and_over_the_limit(namespace: str, name: str, agent_holds: bool, crd_admits: bool) -> None:
    registry_name = names.agent_name(namespace, name)
    try:
        check_adapter_name(registry_name)
        holds = True
    except InvalidRequest:
        holds = False
    crd = len(name) <= crd_name_bound()
    assert (holds, crd) == (agent_holds, crd_admits)
    assert holds or not crd, "a name the CRD admits must fit every agent"
    assert names.is_managed(registry_name, namespace)


def test_a_name_with_a_trailing_newline_is_no_adapter_name() -> None:
    with pytest.raises(InvalidRequest):
        check_adapter_name("lora\n")
