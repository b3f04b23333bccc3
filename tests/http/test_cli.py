"""`lorafleet-agent serve --http-listen`: the HTTP API in the agent process, with the gRPC token
and health that follows the ranks; a bad address is a usage error."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from node_agent.cli import UsageError, build_parser, http_options, server_options
from node_agent.http_api import HttpOptions
from tests.agent.helpers import make_model, wait_until
from tests.http.conftest import write_chat_template

AGENT = Path(sys.executable).parent / "lorafleet-agent"  # the installed console script


def get(url: str, token: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={**headers, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def post(url: str, body: dict, token: str) -> tuple[int, dict]:
    return get(url, token, body)


def rank_pids(parent: int) -> list[int]:
    """The engine's rank processes: the agent's children started by multiprocessing spawn."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def test_serve_with_http_listen_serves_the_api_beside_grpc_until_a_rank_dies(tmp_path):
    """The API in the agent process with gRPC's token; /health is 200 while every rank lives and
    503 naming the failure once one died, inference 503; SIGTERM ends the linger, exit non-zero."""
    model = make_model(tmp_path / "model")
    write_chat_template(model)
    (tmp_path / "token").write_text("s3cret\n")
    log = tmp_path / "agent.log"
    command = [
        str(AGENT),
        "--log-level",
        "INFO",
        "serve",
        "--model",
        str(model),
        "--tp",
        "2",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--auth-token-file",
        str(tmp_path / "token"),
        "--base-model-name",
        "base",
        "--exit-linger-s",
        "120",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    try:
        deadline = time.monotonic() + 180
        while not (match := re.search(r"OpenAI-compatible HTTP API on \S+ \(port (\d+)\)", log.read_text())):
            assert process.poll() is None, f"serve exited with {process.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"serve did not start:\n{log.read_text()}"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{match.group(1)}"
        assert get(f"{url}/health") == (200, {"status": "ok"})
        assert get(f"{url}/v1/models")[0] == 401
        status, models = get(f"{url}/v1/models", "s3cret")
        assert status == 200 and [m["id"] for m in models["data"]] == ["base"]
        chat = {"model": "base", "messages": [{"role": "user", "content": "w4"}], "max_tokens": 3}
        assert post(f"{url}/v1/chat/completions", chat, "s3cret")[0] == 200
        pids = rank_pids(process.pid)
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGKILL)
        wait_until(lambda: get(f"{url}/health")[0] == 503, what="/health to say 503")
        status, health = get(f"{url}/health")
        assert health["status"] == "not serving" and "rank" in health["reason"], health
        status, refusal = post(f"{url}/v1/chat/completions", chat, "s3cret")
        assert status == 503 and refusal["error"]["code"] in ("engine_unavailable", "shutting_down"), refusal
        wait_until(lambda: "engine is not serving" in log.read_text(), what="the agent's watcher to see the death")
        process.send_signal(signal.SIGTERM)  # ends the linger
        assert process.wait(timeout=60) != 0, "the engine died: the pod must restart"
        with pytest.raises(urllib.error.URLError):
            get(f"{url}/health")
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("listen", ["8080", "host:", "host:99999", ":8080"])
def test_a_bad_http_listen_is_a_usage_error(listen):
    args = build_parser().parse_args(["serve", "--model", "m", "--http-listen", listen])
    with pytest.raises(UsageError, match="--http-listen must be HOST:PORT"):
        http_options(args, server_options(args))


def test_the_slow_client_flags_become_the_http_options_and_must_be_positive():
    base = ["serve", "--model", "m", "--http-listen", "127.0.0.1:0"]
    limits = ["--http-header-timeout-s", "2.5", "--http-body-timeout-s", "30", "--http-idle-timeout-s", "5", "--http-max-connections", "7"]
    args = build_parser().parse_args(base + limits)
    options = http_options(args, server_options(args))
    assert options is not None
    assert (options.header_timeout_s, options.body_timeout_s, options.idle_timeout_s, options.max_connections) == (2.5, 30, 5, 7)
    defaults = http_options(build_parser().parse_args(base), server_options(args))
    assert defaults == HttpOptions(listen="127.0.0.1:0"), "the flags' defaults are the options'"
    for flag in ("--http-header-timeout-s", "--http-body-timeout-s", "--http-idle-timeout-s", "--http-max-connections"):
        args = build_parser().parse_args([*base, flag, "0"])
        with pytest.raises(UsageError, match=f"{flag} must be positive, got 0"):
            http_options(args, server_options(args))


def test_the_http_api_takes_the_grpc_token_and_tls_files(tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    for name in ("cert.pem", "key.pem"):
        (tmp_path / name).write_text("-")
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "m",
            "--http-listen",
            "[::1]:8000",
            "--auth-token-file",
            str(tmp_path / "token"),
            "--tls-cert",
            str(tmp_path / "cert.pem"),
            "--tls-key",
            str(tmp_path / "key.pem"),
        ]
    )
    options = http_options(args, server_options(args))
    assert options is not None and options.auth_token == "s3cret" and options.tls == server_options(args).tls
    assert http_options(build_parser().parse_args(["serve", "--model", "m"]), server_options(args)) is None
