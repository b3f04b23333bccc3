"""Real storage servers on loopback for the adapter-source tests, built by scripts/build-storage.sh.

* `S3Server`: versitygw (an S3 gateway, Apache-2.0) over a fresh directory, with a root access
  key and secret; objects go in through the S3 API, signed by the agent's own SigV4 signer
  (never written into the gateway's directory behind its back).
* `RegistryServer`: distribution's ``registry`` over a fresh directory, plain HTTP on loopback;
  artifacts go in with the real ``oras`` client (`push_artifact`). With a `TokenService` it
  takes only pull and push tokens that service signed (distribution's ``auth: token``), which
  the service issues to one user (HTTP basic) as the token protocol has registries' services do.

Both run as children that die with their parent (`processes`), each with its log file.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import http.server
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from lorafleet_dev.processes import ChildProcess, HarnessError, built_bin_dir, free_port
from node_agent.sources.credentials import S3Credential
from node_agent.sources.s3 import sign_s3_request

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build-storage.sh"
BINARIES = ("versitygw", "registry", "oras")
STARTUP_TIMEOUT_S = 60.0
REGION = "us-east-1"
# Media types of an adapter artifact's layers (oras push FILE:TYPE); titles are the file names.
CONFIG_MEDIA_TYPE = "application/vnd.lorafleet.adapter.config.v1+json"
WEIGHTS_MEDIA_TYPE = "application/vnd.lorafleet.adapter.weights.v1+safetensors"
ARTIFACT_TYPE = "application/vnd.lorafleet.adapter.v1"
IMAGE_CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
IMAGE_LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"


def storage_bin_dir() -> Path:
    """The built binaries (``LORAFLEET_STORAGE_BIN_DIR`` overrides); HarnessError naming the
    build script when they are not built (nothing is built here)."""
    return built_bin_dir(
        BUILD_SCRIPT, "LORAFLEET_STORAGE_BIN_DIR", BINARIES, "storage servers (versitygw, registry, oras)", "about 5 minutes"
    )


@dataclass(frozen=True)
class S3Keys:
    """The gateway's root user: what a client signs with."""

    access_key_id: str
    secret_access_key: str


def _accepts_connections(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class S3Server:
    """versitygw serving ``root`` (one directory per bucket) on 127.0.0.1."""

    process: ChildProcess
    port: int
    keys: S3Keys

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _put(self, path: str, body: bytes) -> dict[str, str]:
        """One signed PUT of the root user (path-style, as the agent's GETs); the answer's
        headers. HarnessError with the server's answer when it refuses."""
        url = f"{self.endpoint}/{urllib.parse.quote(path, safe='/-_.~')}"
        credential = S3Credential(self.keys.access_key_id, self.keys.secret_access_key)
        headers = sign_s3_request("PUT", url, credential, REGION, hashlib.sha256(body).hexdigest())
        request = urllib.request.Request(url, data=body, method="PUT", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=STARTUP_TIMEOUT_S) as answer:
                return dict(answer.headers.items())
        except urllib.error.HTTPError as err:
            raise HarnessError(f"PUT {url}: HTTP {err.code}: {err.read()[:500]!r}") from err

    def create_bucket(self, bucket: str) -> None:
        self._put(bucket, b"")

    def put_object(self, bucket: str, key: str, body: bytes) -> str:
        """Store one object through the S3 API; its ETag (without quotes)."""
        return self._put(f"{bucket}/{key}", body).get("ETag", "").strip('"')

    def put_adapter(self, bucket: str, key_prefix: str, adapter: Path, files: tuple[str, ...] | None = None) -> dict[str, str]:
        """Store an adapter directory's files under ``key_prefix/``; each file's ETag by name."""
        names = files if files is not None else tuple(sorted(p.name for p in adapter.iterdir() if p.is_file()))
        return {name: self.put_object(bucket, f"{key_prefix}/{name}", (adapter / name).read_bytes()) for name in names}

    def stop(self) -> None:
        self.process.stop()


def start_s3_server(base: Path, keys: S3Keys) -> S3Server:
    """versitygw over a fresh directory under ``base``, the root user's keys in its environment
    (not on its command line), ready to answer."""
    bin_dir = storage_bin_dir()
    root = base / "s3-root"
    root.mkdir(parents=True)
    port = free_port()
    env = {**os.environ, "ROOT_ACCESS_KEY_ID": keys.access_key_id, "ROOT_SECRET_ACCESS_KEY": keys.secret_access_key}
    argv = [str(bin_dir / "versitygw"), "--port", f"127.0.0.1:{port}", "--region", REGION, "--quiet", "posix", str(root)]
    process = ChildProcess.spawn("versitygw", argv, base, env=env)
    try:
        process.wait_until("versitygw to listen", lambda: _accepts_connections(port), STARTUP_TIMEOUT_S)
    except BaseException:
        process.stop()
        raise
    return S3Server(process, port, keys)


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def es256_jwk(key: ec.EllipticCurvePrivateKey, key_id: str) -> dict[str, str]:
    """The public half of a P-256 key as a JWK (what a JWKS lists)."""
    numbers = key.public_key().public_numbers()
    coordinates = {name: _b64url(value.to_bytes(32, "big")) for name, value in (("x", numbers.x), ("y", numbers.y))}
    return {"kty": "EC", "crv": "P-256", "kid": key_id, "alg": "ES256", "use": "sig", **coordinates}


def sign_es256_jwt(key: ec.EllipticCurvePrivateKey, key_id: str, claims: dict[str, Any]) -> str:
    """A JWT of `claims` signed with a P-256 key (ES256), its header naming `key_id`."""
    header = {"alg": "ES256", "typ": "JWT", "kid": key_id}
    signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
    r, s = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
    return f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


class TokenService(http.server.ThreadingHTTPServer):
    """A registry's token service on 127.0.0.1: ``GET /token?service=...&scope=...`` with one
    user's HTTP basic credentials answers an ES256-signed token granting the scope's actions;
    anything else answers 401. Every request's (query, Authorization) is kept in `seen`."""

    daemon_threads = True
    ISSUER, SERVICE, KEY_ID = "lorafleet-test-tokens", "lorafleet-test-registry", "lorafleet-test-key"

    def __init__(self, user: str, password: str) -> None:
        super().__init__(("127.0.0.1", 0), _TokenHandler)
        self.expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.seen: list[tuple[str, str | None]] = []
        threading.Thread(target=self.serve_forever, name="token-service", daemon=True).start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/token"

    def jwks(self) -> dict[str, Any]:
        """The public key as the registry's ``jwks`` file holds it."""
        return {"keys": [es256_jwk(self.key, self.KEY_ID)]}

    def token(self, scope: str) -> str:
        """A JWT granting ``repository:NAME:ACTIONS`` for five minutes."""
        kind, name, actions = scope.split(":") if scope.count(":") == 2 else ("repository", "", "")
        now = int(time.time())
        claims = {"iss": self.ISSUER, "sub": "tester", "aud": self.SERVICE, "exp": now + 300, "nbf": now - 10, "iat": now}
        claims |= {"jti": str(now), "access": [{"type": kind, "name": name, "actions": actions.split(",")}]}
        return sign_es256_jwt(self.key, self.KEY_ID, claims)

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _TokenHandler(http.server.BaseHTTPRequestHandler):
    server: TokenService

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        authorization = self.headers.get("Authorization")
        self.server.seen.append((query, authorization))
        if path != "/token" or authorization != self.server.expected:
            self.send_error(401)
            return
        scope = urllib.parse.parse_qs(query).get("scope", [""])[0]
        body = json.dumps({"token": self.server.token(scope), "expires_in": 300}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@dataclass
class RegistryServer:
    """distribution's registry on 127.0.0.1, plain HTTP, storing under a directory of its own."""

    process: ChildProcess
    port: int
    oras: Path
    work: Path
    login: tuple[str, str] | None = None  # what oras pushes with, when the registry takes tokens

    @property
    def address(self) -> str:
        """host:port, as oci:// URIs and oras name the registry."""
        return f"127.0.0.1:{self.port}"

    def push_artifact(self, repository: str, tag: str, directory: Path, files: dict[str, str]) -> str:
        """``oras push`` the files of ``directory`` (name -> media type) as one artifact tagged
        ``tag``; the manifest's digest."""
        layers = [f"{name}:{media_type}" for name, media_type in files.items()]
        return self._push(["--artifact-type", ARTIFACT_TYPE], f"{repository}:{tag}", directory, layers)

    def _push(self, options: list[str], reference: str, directory: Path, layers: list[str]) -> str:
        """``oras push`` of FILE:TYPE `layers` from `directory`; the manifest's digest."""
        argv = [str(self.oras), "push", "--plain-http", "--format", "json", *options]
        if self.login is not None:
            argv += ["--username", self.login[0], "--password-stdin"]
        env = {**os.environ, "DOCKER_CONFIG": str(self.work / "docker-config")}
        done = subprocess.run(
            [*argv, f"{self.address}/{reference}", *layers],
            cwd=directory,
            input=self.login[1] if self.login is not None else "",
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if done.returncode != 0:
            raise HarnessError(f"oras push {reference} failed ({done.returncode}): {done.stderr.strip()}")
        return str(json.loads(done.stdout)["digest"])

    def push_adapter(self, repository: str, tag: str, adapter: Path) -> str:
        """Push an adapter directory's two files as an ORAS artifact; the manifest's digest."""
        return self.push_artifact(
            repository, tag, adapter, {"adapter_config.json": CONFIG_MEDIA_TYPE, "adapter_model.safetensors": WEIGHTS_MEDIA_TYPE}
        )

    def push_image(self, repository: str, tag: str, layer: bytes) -> str:
        """Push a one-layer image (an OCI image config, a tar+gzip layer) as KAITO ships
        adapters; the manifest's digest."""
        work = self.work / f"image-{repository.replace('/', '-')}-{tag}"
        work.mkdir(parents=True, exist_ok=True)
        (work / "layer.tar.gz").write_bytes(layer)
        diff_id = "sha256:" + hashlib.sha256(gzip.decompress(layer)).hexdigest()
        config = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [diff_id]}}
        (work / "config.json").write_text(json.dumps(config))
        return self._push(
            ["--config", f"config.json:{IMAGE_CONFIG_MEDIA_TYPE}"], f"{repository}:{tag}", work, [f"layer.tar.gz:{IMAGE_LAYER_MEDIA_TYPE}"]
        )

    def stop(self) -> None:
        self.process.stop()


def _v2_answers(port: int, challenged: bool) -> bool:
    """Whether ``/v2/`` answers as it should: 200, or 401 with a challenge when tokens are due."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=5) as answer:
            return bool(answer.status == 200)
    except urllib.error.HTTPError as error:
        return challenged and error.code == 401 and "Bearer" in error.headers.get("WWW-Authenticate", "")


def start_registry(base: Path, tokens: TokenService | None = None, login: tuple[str, str] | None = None) -> RegistryServer:
    """A registry over a fresh directory under ``base``, answering ``/v2/`` (with `tokens`: only
    requests with that service's tokens; `login`: the user oras pushes as)."""
    bin_dir = storage_bin_dir()
    port = free_port()
    storage = base / "registry-root"
    storage.mkdir(parents=True)
    config = base / "registry.yml"
    # JSON is YAML: the registry reads this as its configuration file.
    settings = {
        "version": 0.1,
        "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }
    if tokens is not None:
        jwks = base / "jwks.json"
        jwks.write_text(json.dumps(tokens.jwks()))
        settings["auth"] = {"token": {"realm": tokens.realm, "service": tokens.SERVICE, "issuer": tokens.ISSUER, "jwks": str(jwks)}}
    config.write_text(json.dumps(settings))
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}
    process = ChildProcess.spawn("registry", [str(bin_dir / "registry"), "serve", str(config)], base, env=env)
    try:
        process.wait_until("the registry to answer /v2/", lambda: _v2_answers(port, challenged=tokens is not None), STARTUP_TIMEOUT_S)
    except BaseException:
        process.stop()
        raise
    return RegistryServer(process, port, bin_dir / "oras", base, login)
