"""Every refusal of the HTTP API with its status and its OpenAI-shaped body, through the official
client (its exception classes) and on the wire; auth with the gRPC token; health and metrics open."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import ssl
import threading

import openai
import pytest

from lorafleet_dev.pki import Authority
from node_agent.auth import TlsFiles
from node_agent.http_api import HttpApiServer, HttpOptions
from node_agent.server import CallBudget
from tests.agent.helpers import wait_until
from tests.http.conftest import BASE, TOKEN, Served, all_blocks_free, request

GOOD = {"model": "ad-a", "prompt": "w1 w2", "max_tokens": 2}
CHAT = {"model": "ad-a", "messages": [{"role": "user", "content": "w4"}], "max_tokens": 2}


def error_of(answer) -> dict:
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/completions", {**GOOD, "temperature": -1}, "temperature", "greater than or equal to 0"),
        ("/v1/completions", {**GOOD, "top_p": 1.5}, "top_p", "less than or equal to 1"),
        ("/v1/completions", {**GOOD, "n": 0}, "n", "greater than or equal to 1"),
        ("/v1/completions", {**GOOD, "max_tokens": 5000}, "max_tokens", "at most 1024"),
        ("/v1/completions", {**GOOD, "stop": ["s"] * 17}, "stop", "at most 16 stop strings"),
        ("/v1/completions", {**GOOD, "stop": [""]}, "stop", "must not be empty"),
        ("/v1/completions", {**GOOD, "prompt": [1, 2, 999]}, "prompt", "outside the vocabulary"),
        ("/v1/completions", {**GOOD, "prompt": ""}, "prompt", "at least 1 character"),
        ("/v1/completions", {**GOOD, "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ("/v1/completions", {**GOOD, "presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ("/v1/completions", {**GOOD, "echo": True}, "echo", "not supported"),
        ("/v1/completions", {k: v for k, v in GOOD.items() if k != "model"}, "model", "Field required"),
        ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, None, "only allowed with stream"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "at least 1 item"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "w4"}]}, "messages.0.role", "Field required"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "w4"}]}, "messages", "unknown role tool"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
            "Input should be",
        ),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2000}, "max_completion_tokens", "at most 1024"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None, "top_logprobs needs logprobs"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(served, path, body, param, says):
    answer = request(served, "POST", path, body)
    error = error_of(answer)
    assert answer.status == 400 and error["type"] == "invalid_request_error" and error["param"] == param, error
    assert says in error["message"]


def test_bad_json_and_unknown_routes_answer_in_the_same_shape(served):
    answer = request(served, "POST", "/v1/completions", raw=b"{not json")
    assert answer.status == 400 and error_of(answer)["code"] == "invalid_json"
    answer = request(served, "GET", "/v1/nothing")
    assert answer.status == 404 and "/v1/nothing" in error_of(answer)["message"]
    answer = request(served, "GET", "/v1/completions")
    assert answer.status == 405 and error_of(answer)["message"]


# Bodies past what `json.loads` reads: bytes that are no UTF-8 text, nesting deeper than the
# recursion it parses by allows, an integer past Python's digit limit, a string that is no
# Unicode (a lone surrogate escape: the tokenizer's TypeError).
UNREADABLE_BODIES = [
    (b'{"model": "ad-a", "prompt": "w1 \xff w2"}', ("not valid UTF-8", "byte 32")),
    (b'{"model": "ad-a", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", ("nests deeper than 64",)),
    (b'{"model": "ad-a", "prompt": "w1", "max_tokens": ' + b"7" * 5000 + b"}", ("integer", "4300 digits")),
    (b'{"model": "ad-a", "prompt": "w1", "messages": [{"role": "user", "content": "w4 \\udc00"}]}', ("unpaired surrogate",)),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("raw", "says"), UNREADABLE_BODIES, ids=["not-utf8", "deep", "long-integer", "lone-surrogate"])
def test_a_body_json_cannot_read_is_400_invalid_json_naming_why(served, path, raw, says):
    answer = request(served, "POST", path, raw=raw)
    error = error_of(answer)
    assert answer.status == 400 and error["code"] == "invalid_json" and error["type"] == "invalid_request_error", error
    assert all(part in error["message"] for part in says), error["message"]
    assert not re.search(r"[A-Za-z]+(Error|Exception)\b", error["message"]), "no Python exception type in the answer"
    assert request(served, "POST", "/v1/completions", GOOD).status == 200, "the agent still serves"


def test_an_escaped_surrogate_pair_is_one_character(served):
    """json.dumps escapes an emoji as a surrogate pair (ensure_ascii): text, not a refusal."""
    body = {**CHAT, "messages": [{"role": "user", "content": "w4 \U0001f600"}]}
    raw = json.dumps(body).encode()
    assert b"\\ud83d\\ude00" in raw
    assert request(served, "POST", "/v1/chat/completions", raw=raw).status == 200


def test_an_unknown_model_is_404_model_not_found(client):
    for call in (
        lambda: client.completions.create(model="no-such", prompt="w1", max_tokens=2),
        lambda: client.chat.completions.create(model="no-such", messages=CHAT["messages"], max_tokens=2, stream=True),
        lambda: client.models.retrieve("no-such"),
    ):
        with pytest.raises(openai.NotFoundError) as raised:
            call()
        assert raised.value.status_code == 404
        assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"
        assert "'no-such'" in raised.value.body["message"]


def test_the_client_sees_400_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="ad-a", prompt="w1", max_tokens=2, temperature=-1)
    assert raised.value.body["param"] == "temperature"


def test_auth_is_the_grpc_bearer_token_and_health_and_metrics_stay_open(served):
    for token, says in ((None, "missing credentials"), ("wrong", "invalid bearer token")):
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", GOOD), ("POST", "/v1/chat/completions", CHAT)):
            answer = request(served, method, path, body, token=token)
            error = error_of(answer)
            assert answer.status == 401 and error["code"] == "invalid_api_key" and says in error["message"], (path, error)
    with pytest.raises(openai.AuthenticationError):
        served.client(api_key="wrong").models.list()
    assert request(served, "GET", "/health", token=None).json() == {"status": "ok"}
    assert "vllm:num_requests_running" in request(served, "GET", "/metrics", token=None).body.decode()
    assert served.client(api_key=TOKEN).models.list().data


def side_server(served: Served, **kwargs) -> HttpApiServer:
    """A second HTTP API over the shared agent (its own budget or shutdown flag)."""
    server = HttpApiServer(served.agent, HttpOptions(listen="127.0.0.1:0", stop_grace_s=0), **kwargs)
    server.start()
    return server


def test_over_the_inference_budget_is_429_at_once(served):
    budget = CallBudget("inference", 1, "--max-inference-calls")
    with side_server(served, budget=budget) as side:
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{side.port}/v1", api_key="-", max_retries=0, timeout=60)
        stream = other.completions.create(model="ad-a", prompt="w1 w2", max_tokens=1000, stream=True)
        next(iter(stream))  # holds the only place
        try:
            with pytest.raises(openai.RateLimitError) as raised:
                other.completions.create(**GOOD)
            assert raised.value.status_code == 429 and raised.value.body["code"] == "too_many_calls"
            assert "--max-inference-calls" in raised.value.body["message"]
        finally:
            stream.close()
        wait_until(lambda: budget.running == 0, what="the stream's place to be released")
        assert other.completions.create(**GOOD).choices[0].finish_reason == "length"
    wait_until(lambda: all_blocks_free(served), what="every block free")


def test_a_stopping_agent_answers_503_and_health_says_why(served):
    closing = threading.Event()
    with side_server(served, closing=closing) as side:
        closing.set()
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{side.port}/v1", api_key="-", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as raised:
            other.completions.create(**GOOD)
        assert raised.value.status_code == 503 and raised.value.body["code"] == "shutting_down"
        assert other.models.list().data[0].id == BASE, "listing still answers"
        connection = http.client.HTTPConnection("127.0.0.1", side.port, timeout=30)
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 503 and b"shutting down" in response.read()
        connection.close()


def test_chat_without_a_chat_template_is_a_clear_400(served):
    config = served.model / "tokenizer_config.json"
    kept = config.with_suffix(".kept")
    shutil.move(config, kept)
    try:
        side = side_server(served)  # reads the model directory's template when it starts
    finally:
        shutil.move(kept, config)
    with side:
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{side.port}/v1", api_key="-", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as raised:
            other.chat.completions.create(**CHAT)
        assert raised.value.body["code"] == "chat_template_missing" and "chat_template" in raised.value.body["message"]
        assert other.completions.create(**GOOD).choices[0].text, "completions need no template"


def test_with_grpcs_tls_files_the_api_is_https_and_mutual_tls_needs_a_client_certificate(served, tmp_path):
    ca = Authority("lorafleet test CA")
    ca.issue("agent", server=True).write(tmp_path / "server.crt", tmp_path / "server.key")
    (tmp_path / "ca.crt").write_bytes(ca.pem)
    ca.issue("client", server=False).write(tmp_path / "client.crt", tmp_path / "client.key")
    tls = TlsFiles(tmp_path / "server.crt", tmp_path / "server.key", tmp_path / "ca.crt")
    with HttpApiServer(served.agent, HttpOptions(listen="127.0.0.1:0", tls=tls, stop_grace_s=0)) as side:

        def status(context: ssl.SSLContext) -> int:
            connection = http.client.HTTPSConnection("localhost", side.port, context=context, timeout=30)
            try:
                connection.request("GET", "/health")
                return connection.getresponse().status
            finally:
                connection.close()

        trusting = ssl.create_default_context(cadata=ca.pem.decode())
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            status(trusting)  # no client certificate
        trusting.load_cert_chain(tmp_path / "client.crt", tmp_path / "client.key")
        assert status(trusting) == 200
        with pytest.raises(ssl.SSLCertVerificationError):
            status(ssl.create_default_context())  # the agent's CA is not the system's


def test_an_unexpected_error_is_a_500_in_the_same_shape_and_in_stream_after_the_200(served, monkeypatch, caplog):
    """A bug (injected: building the answer fails) answers 500 `internal`; once a stream has
    started, the error is its last event before `[DONE]`; the sequence is cancelled either way.
    The answer names no Python exception and none of its text: a reference the agent's log
    gives the cause under."""
    from node_agent.http_api.responses import Reply

    def broken(*_args, **_kwargs):
        raise RuntimeError("injected")

    def hides_the_cause(error: dict) -> None:
        assert error["code"] == "internal", error
        assert "RuntimeError" not in error["message"] and "injected" not in error["message"], error
        reference = re.search(r"reference ([0-9a-f]{12})", error["message"])
        assert reference, error
        logged = [record for record in caplog.records if reference[1] in record.getMessage()]
        assert logged and logged[0].exc_info and "injected" in str(logged[0].exc_info[1]), "the log has the cause"

    monkeypatch.setattr(Reply, "body", broken)
    answer = request(served, "POST", "/v1/completions", GOOD)
    assert answer.status == 500
    hides_the_cause(error_of(answer))
    monkeypatch.setattr(Reply, "chunk", broken)
    before = served.agent.engine.serving_stats().steps
    answer = request(served, "POST", "/v1/completions", {**GOOD, "max_tokens": 1000, "stream": True})
    events = answer.events()
    assert answer.status == 200 and events[-1] == "[DONE]"
    hides_the_cause(json.loads(events[-2])["error"])
    wait_until(lambda: all_blocks_free(served), what="the failed stream's sequence to be cancelled")
    assert served.agent.engine.serving_stats().steps - before < 999, "cancelled, not run to its end"
