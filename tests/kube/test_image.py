"""The image definition (Containerfile, .dockerignore) and the dependency split it relies on.

These tests read the definition (tests/kube/test_real_node.py builds and runs both images): its
stages and targets, the base as a build argument, the non-root user, the OCI labels, the entry
points, that the operator's stages never install the `agent` extra nor copy node_agent/, the
agent's layering (dependencies keyed by the dependency set, code on top), and that the build
context leaves out what the images must not contain. The dependency split is checked against
the code: every third-party module the operator side imports comes from `[project]
dependencies` (or what they require), and none of the agent's heavy packages is among them.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import re
import sys
import tomllib
from dataclasses import dataclass, field

import pytest

from lorafleet_dev.images import OPERATOR_SOURCES
from tests.kube.harness import CHECKOUT

ROOT = CHECKOUT.root
CONTAINERFILE = ROOT / "Containerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
UID = "65532"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse(text: str) -> tuple[list[tuple[str, str]], dict[str, Stage]]:
    """(instructions before the first FROM, stages by name in order), continuations joined."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "a continuation runs off the end of the Containerfile"
    preamble: list[tuple[str, str]] = []
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        op, _, arg = line.partition(" ")
        op, arg = op.upper(), arg.strip()
        if op == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", arg, re.IGNORECASE)
            assert m, f"every stage is named: FROM {arg}"
            current = Stage(m.group(2), m.group(1))
            assert current.name not in stages, f"stage {current.name} defined twice"
            stages[current.name] = current
        elif current is None:
            preamble.append((op, arg))
        else:
            current.instructions.append((op, arg))
    return preamble, stages


PREAMBLE, STAGES = parse(CONTAINERFILE.read_text())


def chain(name: str) -> list[Stage]:
    """A stage and every stage it is built on or copies from (its whole ancestry)."""
    seen: list[Stage] = []
    todo = [name]
    while todo:
        stage = STAGES[todo.pop()]
        if stage in seen:
            continue
        seen.append(stage)
        if stage.base in STAGES:
            todo.append(stage.base)
        for copy in stage.args("COPY"):
            m = re.search(r"--from=(\S+)", copy)
            if m:
                assert m.group(1) in STAGES, f"COPY --from={m.group(1)} names no stage"
                todo.append(m.group(1))
    return seen


def test_the_base_is_a_build_argument() -> None:
    assert ("ARG", "BASE=python:3.11-slim-bookworm") in PREAMBLE
    for stage in STAGES.values():
        assert stage.base == "${BASE}" or stage.base in STAGES, (stage.name, stage.base)


def test_two_final_targets_with_their_console_scripts() -> None:
    assert list(STAGES)[-2:] == ["operator", "agent"]
    scripts = PYPROJECT["project"]["scripts"]
    for target, script in (("operator", "lorafleet-operator"), ("agent", "lorafleet-agent")):
        assert script in scripts
        assert STAGES[target].args("ENTRYPOINT") == [f'["{script}"]']


@pytest.mark.parametrize("target", ["operator", "agent"])
def test_final_stages_run_as_the_fixed_non_root_user(target: str) -> None:
    users = [u for stage in reversed(chain(target)) for u in stage.args("USER")]
    assert users, f"{target} sets no USER"
    assert users[-1] in (UID, f"{UID}:{UID}")
    assert STAGES[target].args("USER")[-1] == users[-1]


@pytest.mark.parametrize("target", ["operator", "agent"])
def test_final_stages_carry_no_build_tools(target: str) -> None:
    """The final stages are the base plus a user and a copied environment, and for the agent one
    C compiler layer (below): nothing else installs build tools there, and the environment they
    copy has had pip and setuptools removed."""
    runtime = [s for s in chain(target) if not s.name.startswith("build")]
    runs = " ".join(r for s in runtime for r in s.args("RUN") if r != compiler_layer(target))
    for tool in ("apt-get", "apt ", "gcc", "build-essential", "pip install", "make "):
        assert tool not in runs, (target, tool)
    builders = [s for s in chain(target) if s.name.startswith("build-") and carries_environment(target, s)]
    assert builders, f"{target} copies from no build stage"
    for builder in builders:
        assert any("pip uninstall --yes pip setuptools wheel" in r for r in builder.args("RUN"))


def compiler_layer(target: str) -> str | None:
    """The RUN of ``target``'s own stage that installs a C compiler (None where there is none)."""
    runs = [r for r in STAGES[target].args("RUN") if "apt-get install" in r]
    assert len(runs) <= 1, runs
    return runs[0] if runs else None


def test_only_the_agent_carries_a_c_compiler_above_its_dependency_layer() -> None:
    """Triton builds its CUDA driver module with a C compiler at first use on a GPU node
    (docs/deploy.md, "Images"): the agent installs gcc, libc's headers and, where the base has
    none, Python's, in one layer of its own stage (on the dependency layer, which the build cache
    keeps, and below the code), with no recommended extras and no apt lists left behind. The
    operator installs none."""
    assert compiler_layer("operator") is None
    run = compiler_layer("agent")
    assert run is not None
    assert "apt-get install --yes --no-install-recommends gcc libc6-dev $headers" in run
    assert 'sysconfig.get_path("include", "posix_prefix")' in run and "libpython%d.%d-dev" in run
    assert "g++" not in run and "build-essential" not in run
    assert "apt-get clean" in run and "rm -rf /var/lib/apt/lists/*" in run
    ops = [op for op, _ in STAGES["agent"].instructions]
    assert ops[0] == "RUN", "the compiler layer comes first, so label or environment edits keep it cached"
    assert ops.index("RUN") < ops.index("COPY")


def carries_environment(target: str, stage: Stage) -> bool:
    """Whether the final image holds ``stage``'s virtual environment: ``target`` is built on it
    or copies its /opt/lorafleet whole (a stage whose pip only installed elsewhere, e.g. the
    agent's code into /opt/lorafleet/app, is not carried)."""
    ancestry, current = [], STAGES[target]
    while True:
        ancestry.append(current)
        if current.base not in STAGES:
            break
        current = STAGES[current.base]
    copies = [c for s in ancestry for c in s.args("COPY")]
    return stage in ancestry or f"--from={stage.name} /opt/lorafleet /opt/lorafleet" in copies


def test_the_operator_never_installs_the_agent_extra() -> None:
    text = " ".join(arg for stage in chain("operator") for _, arg in stage.instructions)
    assert "[agent]" not in text
    assert '["optional-dependencies"]' not in text
    for heavy in ("torch", "triton", "nvidia"):
        assert heavy not in text.lower(), heavy
    operator_runs = [r for s in chain("operator") for r in s.args("RUN")]
    assert any('sorted(p["dependencies"])' in r for r in operator_runs)


@pytest.mark.parametrize("target", ["operator", "agent"])
def test_each_image_installs_its_dependency_set_then_the_project_alone(target: str) -> None:
    """Each image installs [project] dependencies (plus the agent extra for the agent), read
    from pyproject.toml into a requirements file (its dependency layer is keyed by that file's
    content alone), and then the project itself without dependencies."""
    runs = [r for s in chain(target) for r in s.args("RUN")]
    if target == "agent":
        assert any('p["dependencies"] + p["optional-dependencies"]["agent"]' in r for r in runs)
    assert any("pip install --requirement /tmp/requirements.txt" in r for r in runs)
    assert any("pip install --no-deps" in r and "--target=/opt/lorafleet/app ." in r for r in runs)


@pytest.mark.parametrize("target", ["operator", "agent"])
def test_the_dependency_layer_sees_only_the_dependency_set(target: str) -> None:
    """The stage installing an image's dependencies copies nothing but the requirements file
    (so an edit of code or of pyproject.toml's other tables leaves the layer cached), the final
    image is built on that stage (one layer, not a copy of it), and the code is copied last."""
    deps = STAGES[f"build-{target}-deps"]
    assert deps.args("COPY") == [f"--from={target}-requirements /src/requirements.txt /tmp/requirements.txt"]
    assert STAGES[f"{target}-requirements"].args("COPY") == ["pyproject.toml ./"]
    assert STAGES[target].base == f"build-{target}-deps"
    assert STAGES[target].args("COPY") == [f"--from=build-{target}-app /opt/lorafleet/app /opt/lorafleet/app"]
    ops = [op for op, _ in STAGES[target].instructions]
    assert ops[ops.index("COPY") :] in (["COPY", "USER", "EXPOSE", "ENTRYPOINT"], ["COPY", "USER", "ENTRYPOINT"])


def test_the_operator_image_holds_no_agent_code() -> None:
    """The operator's stages copy only its sources (never node_agent/), which are exactly what
    lorafleet_dev.images hashes for the operator image's cache key."""
    sources = [src.rstrip("/") for s in chain("operator") for c in s.args("COPY") if not c.startswith("--from") for src in c.split()[:-1]]
    assert "node_agent" not in sources
    assert sorted(set(sources)) == sorted(OPERATOR_SOURCES)
    runs = " ".join(r for s in chain("operator") for r in s.args("RUN"))
    assert "rm /opt/lorafleet/app/bin/lorafleet-agent" in runs


def test_oci_labels_name_the_source_and_the_pyproject_version() -> None:
    version = PYPROJECT["project"]["version"]
    for target in ("operator", "agent"):
        stages = chain(target)
        labels = " ".join(label for s in stages for label in s.args("LABEL"))
        args = [a for s in stages for a in s.args("ARG")]
        assert f"VERSION={version}" in args, "the VERSION default must equal pyproject's version"
        assert 'org.opencontainers.image.version="${VERSION}"' in labels
        assert "org.opencontainers.image.source=" in labels
        assert f'org.opencontainers.image.title="lorafleet-{target}"' in labels


def test_what_the_build_copies_exists() -> None:
    copies = [c for s in STAGES.values() for c in s.args("COPY") if not c.startswith("--from")]
    assert copies
    for copy in copies:
        *sources, _dest = copy.split()
        for src in sources:
            assert (ROOT / src).exists(), src
            assert not ignored(src.rstrip("/")), f"{src} is copied but .dockerignore drops it"


# ---- .dockerignore -------------------------------------------------------------------------


def ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def matches(pattern: str, path: str) -> bool:
    """Docker's rule, as far as this file uses it: a pattern matches a path or any directory
    above it; `**/` matches any number of leading directories."""
    pattern = pattern.rstrip("/")
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    if pattern.startswith("**/"):
        tail = pattern[3:]
        return any(fnmatch.fnmatchcase(p.split("/")[-1], tail) or fnmatch.fnmatchcase(p, tail) for p in prefixes)
    return any(fnmatch.fnmatchcase(p, pattern) for p in prefixes)


def ignored(path: str) -> bool:
    """The last matching pattern decides; `!` re-includes."""
    verdict = False
    for pattern in ignore_patterns():
        negate = pattern.startswith("!")
        if matches(pattern.lstrip("!"), path):
            verdict = not negate
    return verdict


@pytest.mark.parametrize(
    "path",
    [
        ".git/config",
        ".venv/bin/python",
        "tests/kube/test_image.py",
        "devtools/pyproject.toml",
        "benchmarks/bench_agent.py",
        "docs/agent.md",
        "deploy/helm/lorafleet/values.yaml",
        "node_agent/__pycache__/cli.cpython-311.pyc",
        "operator/.mypy_cache/x",
        ".ruff_cache/x",
        "scripts/bootstrap.sh",
    ],
)
def test_dockerignore_keeps_out(path: str) -> None:
    assert ignored(path)


@pytest.mark.parametrize(
    "path",
    [
        "pyproject.toml",
        "README.md",
        "node_agent/cli.py",
        "node_agent/engine/driver/engine.py",
        "proto/lorafleet/v1/agent_pb2.py",
        "common/lorafleet_common/merge.py",
        "operator/lorafleet_operator/main.py",
    ],
)
def test_dockerignore_keeps_in(path: str) -> None:
    assert not ignored(path)


# ---- the dependency split --------------------------------------------------------------------

AGENT_ONLY = {
    "torch",
    "triton",
    "safetensors",
    "numpy",
    "tokenizers",
    "google-re2",
    "jsonschema",
    "grpcio-health-checking",
    "grpcio-reflection",
    "aiohttp",
    "pydantic",
    "jinja2",
    "huggingface-hub",
    "awscrt",
}


def dist_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def closure(requirements: list[str]) -> set[str]:
    """The distributions these requirements install, transitively (from what is installed)."""
    seen: set[str] = set()
    todo = [dist_name(r) for r in requirements]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [dist_name(r) for r in requires if "extra ==" not in r]
    return seen


def imported_modules(*dirs: str) -> set[str]:
    names: set[str] = set()
    for d in dirs:
        for path in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module.split(".")[0])
    return names


def test_dependencies_split_between_operator_and_agent() -> None:
    deps = {dist_name(r) for r in PYPROJECT["project"]["dependencies"]}
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {dist_name(r) for r in extras["agent"]} == AGENT_ONLY
    assert not deps & AGENT_ONLY, "the operator image would install the agent's packages"
    assert {"grpcio", "protobuf", "prometheus-client", "kopf", "kubernetes"} <= deps


def test_the_operator_side_imports_only_its_dependencies() -> None:
    """Every third-party module that operator/, common/ and proto/ import is installed by
    `pip install .` (the operator image), not only by the `agent` extra."""
    ours = {"lorafleet", "lorafleet_common", "lorafleet_operator", "node_agent", "lorafleet_dev"}
    third_party = imported_modules("operator", "common", "proto") - ours - set(sys.stdlib_module_names)
    providers = importlib.metadata.packages_distributions()
    installed = closure(PYPROJECT["project"]["dependencies"])
    missing = {m: providers.get(m) for m in third_party if not {dist_name(d) for d in providers.get(m, [])} & installed}
    assert missing == {}
