"""The HTTP API's requests queue for the inference budget as gRPC's calls do, on the event loop
without blocking it: a second HTTP API over the shared agent with a budget of one place (held by
the test, as a running request would hold it) and a queue of two."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from node_agent.http_api import HttpApiServer, HttpOptions
from node_agent.server import CallBudget, QueueRule
from tests.agent.helpers import wait_until
from tests.http.conftest import Answer, Served, all_blocks_free

GOOD = {"model": "ad-a", "prompt": "w1 w2", "max_tokens": 2}
QUEUE = QueueRule(2, 60.0, "--max-queued-inference-calls", "--inference-queue-wait-s")


@contextmanager
def _side(served: Served, budget: CallBudget) -> Iterator[int]:
    """A second HTTP API over the shared agent with `budget`; its port."""
    with HttpApiServer(served.agent, HttpOptions(listen="127.0.0.1:0", stop_grace_s=0), budget=budget) as side:
        yield side.port
    wait_until(lambda: all_blocks_free(served), what="every block free")


def _call(port: int, method: str, path: str, body: object = None, timeout: float = 120) -> Answer:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        connection.close()


def test_requests_beyond_the_budget_queue_and_beyond_the_queue_get_429(served):
    budget = CallBudget("inference", 1, "--max-inference-calls", QUEUE)
    with _side(served, budget) as port:
        budget.acquire()  # the one place
        with ThreadPoolExecutor(3) as pool:
            try:
                calls = [pool.submit(_call, port, "POST", "/v1/completions", GOOD) for _ in range(3)]
                wait_until(lambda: budget.waiting == 2 and sum(call.done() for call in calls) == 1, what="two queued, one refused")
                (refused,) = [call.result() for call in calls if call.done()]
                error = refused.json()["error"]
                assert refused.status == 429 and error["code"] == "too_many_calls", error
                assert "2 waiting, the queue's limit is 2 (--max-queued-inference-calls)" in error["message"]
                # The event loop is free while two requests wait on it.
                assert _call(port, "GET", "/health").json() == {"status": "ok"}
                assert budget.waiting == 2
            finally:
                budget.release()  # to the first queued request, which hands it on as it ends
            answers = [call.result() for call in calls if call.result() is not refused]
        assert [answer.status for answer in answers] == [200, 200]
        assert all(answer.json()["choices"][0]["finish_reason"] == "length" for answer in answers)
        assert (budget.running, budget.waiting) == (0, 0)


def test_a_queued_request_gets_429_after_the_queues_wait(served):
    budget = CallBudget("inference", 1, "--max-inference-calls", QueueRule(2, 0.2, QUEUE.size_flag, QUEUE.wait_flag))
    with _side(served, budget) as port:
        budget.acquire()
        try:
            answer = _call(port, "POST", "/v1/completions", GOOD)
        finally:
            budget.release()
        error = answer.json()["error"]
        assert answer.status == 429 and error["code"] == "queue_timeout", error
        assert "within 0.2 s (--inference-queue-wait-s)" in error["message"]
        assert _call(port, "POST", "/v1/completions", GOOD).status == 200
        assert (budget.running, budget.waiting) == (0, 0)


def test_a_client_that_goes_away_while_queued_leaves_the_queue_and_takes_no_place(served):
    budget = CallBudget("inference", 1, "--max-inference-calls", QUEUE)
    with _side(served, budget) as port:
        budget.acquire()
        try:
            with ThreadPoolExecutor(1) as pool:
                gone = pool.submit(_call, port, "POST", "/v1/completions", GOOD, 0.5)
                assert isinstance(gone.exception(), socket.timeout)
            wait_until(lambda: budget.waiting == 0, what="the request to leave the queue")
        finally:
            budget.release()
        assert (budget.running, budget.waiting) == (0, 0)
