"""Generate through the engine's scheduler, over gRPC against the shared agent (tp=2, dp=2):
concurrent streams share steps and still give each one's own greedy tokens, sampling
parameters reach the sampler, a stream that goes away frees its KV blocks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from tests.agent.helpers import generate, rpc_error, wait_until

PROMPTS = [[1, 2, 3, 255, 0, 17], [9, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7]]


def load(stub, name: str, path) -> None:
    assert stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=path.as_uri()), timeout=60).success


def sampled(stub, tokens: list[int], adapter: str = "", n: int = 12, **sampling) -> list[int]:
    request = pb.GenerateRequest(token_ids=tokens, adapter=adapter, max_new_tokens=n, **sampling)
    return [reply.token_id for reply in stub.Generate(request, timeout=120)]


def all_blocks_free(shared) -> bool:
    stats = shared.agent.engine.serving_stats()
    return stats.running == 0 and stats.waiting == 0 and stats.free_blocks == (stats.num_blocks,) * len(stats.free_blocks)


def test_concurrent_streams_equal_each_alone(shared, stub):
    load(stub, "s1", shared.adapters["ad1"])
    load(stub, "s2", shared.adapters["ad2"])
    calls = [(prompt, adapter, 5 + 3 * i) for i, prompt in enumerate(PROMPTS) for adapter in ("", "s1", "s2")]
    alone = [generate(stub, prompt, adapter, n) for prompt, adapter, n in calls]
    with ThreadPoolExecutor(len(calls)) as pool:
        together = list(pool.map(lambda call: generate(stub, *call), calls))
    assert together == alone
    assert all_blocks_free(shared)


def test_seeded_sampling_repeats_and_the_seed_matters(shared, stub):
    sampling = dict(temperature=1.0, top_p=0.9, top_k=40, min_p=0.01, seed=77)
    first = sampled(stub, PROMPTS[0], **sampling)
    assert sampled(stub, PROMPTS[0], **sampling) == first
    assert sampled(stub, PROMPTS[0], **{**sampling, "seed": 78}) != first, "premise: the seed matters"
    assert sampled(stub, PROMPTS[0], **{**sampling, "temperature": 0.0}) == sampled(stub, PROMPTS[0]), "temperature 0 is greedy"


@pytest.mark.parametrize(("field", "value"), [("temperature", -1.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0)])
def test_invalid_sampling_is_refused_naming_the_field(stub, field, value):
    error = rpc_error(lambda: sampled(stub, PROMPTS[0], **{field: value}))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and f"SamplingParams.{field}" in error.details()


def test_a_stream_that_goes_away_frees_its_blocks(shared, stub):
    before = shared.agent.engine.serving_stats().steps
    stream = stub.Generate(pb.GenerateRequest(token_ids=PROMPTS[2], max_new_tokens=1000), timeout=120)
    next(stream)
    stream.cancel()
    wait_until(lambda: all_blocks_free(shared), what="the cancelled sequence's blocks to be freed")
    assert shared.agent.engine.serving_stats().steps - before < 999, "the sequence was cancelled, not run to its end"


def test_logprobs_usage_and_the_finish_enum(stub):
    import numpy as np

    from tests.agent.helpers import forward

    prompt, n = PROMPTS[0], 5
    replies = list(stub.Generate(pb.GenerateRequest(token_ids=prompt, max_new_tokens=n, logprobs=3), timeout=120))
    tokens = [r.token_id for r in replies]
    assert [r.finish for r in replies] == [pb.FINISH_REASON_UNSPECIFIED] * (n - 1) + [pb.FINISH_REASON_LENGTH]
    assert [r.HasField("usage") for r in replies] == [False] * (n - 1) + [True]
    assert (replies[-1].usage.prompt_tokens, replies[-1].usage.completion_tokens) == (len(prompt), n)
    logits = forward(stub, (prompt + tokens[:-1], ""))[0]
    for i, reply in enumerate(replies):
        row = logits[len(prompt) - 1 + i].astype(np.float64)
        logprobs = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert len(reply.top_logprobs) == 3 and reply.top_logprobs[0].token_id == reply.token_id  # greedy
        assert [t.token_id for t in reply.top_logprobs] == list(np.argsort(-logprobs, kind="stable")[:3])
        assert abs(reply.logprob - logprobs[reply.token_id]) < 1e-4
        assert reply.top_logprobs[0].logprob == pytest.approx(reply.logprob)
    plain = next(iter(stub.Generate(pb.GenerateRequest(token_ids=prompt, max_new_tokens=1), timeout=120)))
    assert not plain.HasField("logprob") and not plain.top_logprobs and plain.finish == pb.FINISH_REASON_LENGTH
