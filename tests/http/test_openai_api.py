"""The OpenAI-compatible API with the official `openai` client against the shared agent (tp=2,
dp=2): models, completions and chat completions (the same greedy tokens as gRPC Generate),
streaming with usage, stop strings (also through gRPC), n, seeds and logprobs."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from lorafleet.v1 import agent_pb2 as pb
from tests.agent.helpers import LOOPBACK_SOURCES, WORDS, http_server, make_adapter, wait_until
from tests.http.conftest import ADAPTERS, BASE, all_blocks_free, grpc_generate, request
from tests.support.models import quiet_transformers

PROMPT = "w1 w2 w3 w40 w41"
IDS = [WORDS.index(word) for word in PROMPT.split()]
CHAT = [{"role": "system", "content": "w6"}, {"role": "user", "content": "w7 w8 w9"}]


def ids_of(text: str) -> list[int]:
    return [WORDS.index(word) for word in text.split()]


def test_models_lists_the_base_model_and_every_routable_adapter(served, client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {BASE, *ADAPTERS}
    for name in ADAPTERS:
        card = models[name].model_dump()
        assert card["object"] == "model" and card["owned_by"] == "lorafleet" and card["created"] > 0
        assert card["parent"] == BASE and card["root"].startswith("file://") and card["root"].endswith(f"/{name}")
    assert models[BASE].model_dump()["parent"] is None
    assert client.models.retrieve("ad-a").id == "ad-a"


def test_an_adapter_disappears_from_models_when_its_unload_starts(served, client, tmp_path):
    """An unload that drains a running request: the adapter is gone from the list (and refused)
    from the moment the unload starts, not when it completes."""
    root = served.agent.config.sources.adapter_roots[0]
    path = make_adapter(root / "ad-gone", seed=300)
    assert served.agent.load("ad-gone", path.as_uri()).ok
    assert "ad-gone" in {m.id for m in client.models.list().data}
    stream = client.completions.create(model="ad-gone", prompt=PROMPT, max_tokens=1000, stream=True)
    next(iter(stream))  # the request runs and holds the adapter: the unload must drain it
    unloading = threading.Thread(target=served.agent.unload, args=("ad-gone",))
    unloading.start()
    try:
        wait_until(lambda: "ad-gone" not in {m.id for m in client.models.list().data}, what="ad-gone to leave the list")
        assert unloading.is_alive(), "premise: the unload is still draining the running request"
        answer = request(served, "POST", "/v1/completions", {"model": "ad-gone", "prompt": PROMPT})
        assert answer.status == 404 and answer.json()["error"]["code"] == "model_not_found"
        assert "being unloaded" in answer.json()["error"]["message"]
    finally:
        stream.close()
        unloading.join(timeout=60)
    assert not unloading.is_alive()
    wait_until(lambda: all_blocks_free(served), what="every block free")


@pytest.mark.parametrize("model", ["ad-a", BASE])
def test_a_greedy_completion_gives_the_grpc_generate_tokens(served, client, model):
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    adapter = "" if model == BASE else model
    grpc = grpc_generate(served, prompt=PROMPT, adapter=adapter, max_new_tokens=8)
    choice = completion.choices[0]
    assert ids_of(choice.text) == [r.token_id for r in grpc] == ids_of(" ".join(choice.logprobs.tokens))
    assert choice.text == "".join(r.text for r in grpc)
    assert choice.finish_reason == "length" and completion.model == model
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (5, 8, 13)
    if model != BASE:
        base = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=8, temperature=0)
        assert base.choices[0].text != choice.text, "premise: the adapter changes the greedy tokens"


def test_a_chat_completion_renders_the_template_as_transformers_and_gives_the_grpc_tokens(served, client):
    quiet_transformers()
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(str(served.model)).apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    chat = client.chat.completions.create(model="ad-b", messages=CHAT, max_completion_tokens=6, temperature=0)
    grpc = grpc_generate(served, token_ids=list(prompt_ids), adapter="ad-b", max_new_tokens=6)
    message = chat.choices[0].message
    assert message.role == "assistant" and ids_of(message.content) == [r.token_id for r in grpc]
    assert chat.object == "chat.completion" and chat.choices[0].finish_reason == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(prompt_ids), 6)


def test_streaming_gives_the_same_text_and_a_last_chunk_with_usage(served, client):
    whole = client.chat.completions.create(model="ad-a", messages=CHAT, max_tokens=7, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="ad-a", messages=CHAT, max_tokens=7, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens"}) == whole.usage.model_dump(
        include={"prompt_tokens", "completion_tokens"}
    )
    assert all(c.usage is None for c in chunks[:-1])
    # On the wire: server-sent events, the last one `[DONE]`; without include_usage no usage chunk.
    answer = request(served, "POST", "/v1/completions", {"model": "ad-a", "prompt": PROMPT, "max_tokens": 3, "stream": True})
    assert answer.status == 200 and answer.headers["content-type"].startswith("text/event-stream")
    events = answer.events()
    assert events[-1] == "[DONE]" and len(events) == 4 and all('"usage"' not in e for e in events)


def test_stop_strings_end_the_text_before_them_and_cancel_the_sequence(served, client):
    full = client.completions.create(model="ad-a", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    words = full.split()
    stop = f" {words[3]} {words[4]}"  # two tokens: the first is held back until the second decides
    assert full.find(stop) == len(" ".join(words[:3])), "premise: the stop string first occurs at word 3"
    expected = full[: full.find(stop)]
    before = served.agent.engine.serving_stats().steps
    stopped = client.completions.create(model="ad-a", prompt=PROMPT, max_tokens=1000, temperature=0, stop=[stop, "w256"])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (expected, "stop")
    assert stopped.usage.completion_tokens == 5  # generation ended at the token completing the stop string
    assert served.agent.engine.serving_stats().steps - before < 100, "the sequence was cancelled in the engine"
    wait_until(lambda: all_blocks_free(served), what="every block free")
    # Streamed, no delta ever carries text that a later stop string match removes.
    emitted = ""
    for chunk in client.completions.create(model="ad-a", prompt=PROMPT, max_tokens=1000, temperature=0, stop=stop, stream=True):
        emitted += chunk.choices[0].text
        assert expected.startswith(emitted), f"emitted {emitted!r}: not a prefix of {expected!r}"
    assert emitted == expected
    # gRPC Generate: the same matcher.
    grpc = grpc_generate(served, prompt=PROMPT, adapter="ad-a", max_new_tokens=1000, stop=[stop])
    assert "".join(r.text for r in grpc) == expected and len(grpc) == 5
    assert grpc[-1].finish == pb.FINISH_REASON_STOP and grpc[-1].finish_reason == "stop"


def test_n_choices_and_seeds_repeat_each_request_exactly(client):
    def sample(seed: int | None) -> list[str]:
        reply = client.completions.create(model="ad-b", prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.95, n=3, seed=seed)
        assert sorted(c.index for c in reply.choices) == [0, 1, 2] and reply.usage.completion_tokens == 24
        assert reply.usage.prompt_tokens == 5  # the prompt is counted once, not once per choice
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first
    assert len(set(first)) == 3, "each choice draws its own tokens"
    assert sample(8) != first, "premise: the seed matters"
    greedy = client.chat.completions.create(model="ad-b", messages=CHAT, max_tokens=5, temperature=0, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_logprobs_are_the_grpc_logprobs_in_openais_shapes(served, client):
    completion = client.completions.create(model="ad-a", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3).choices[0]
    grpc = grpc_generate(served, prompt=PROMPT, adapter="ad-a", max_new_tokens=4, logprobs=3)
    lp = completion.logprobs
    assert lp.tokens == [WORDS[r.token_id] for r in grpc]
    np.testing.assert_allclose(lp.token_logprobs, [r.logprob for r in grpc], rtol=0, atol=1e-6)
    assert [list(top) for top in lp.top_logprobs] == [[WORDS[t.token_id] for t in r.top_logprobs] for r in grpc]
    assert lp.text_offset == [len("".join(r.text for r in grpc[:i])) for i in range(len(grpc))]
    chat = client.chat.completions.create(model="ad-a", messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == chat.choices[0].message.content.split()
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token  # greedy: the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) and entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model="ad-a", messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_health_models_and_inference_answer_while_a_load_is_held(served, client, monkeypatch, tmp_path):
    """A LoadAdapter whose download a loopback server holds does not delay /health, /v1/models,
    /metrics or a completion; the adapter is listed only once every rank holds it."""
    sources = dataclasses.replace(
        served.agent.config.sources, cache_dir=tmp_path, download_timeout_s=300, download_min_bytes_per_s=0, **LOOPBACK_SOURCES
    )
    monkeypatch.setattr(served.agent, "config", dataclasses.replace(served.agent.config, sources=sources))
    root = served.agent.config.sources.adapter_roots[0]
    with http_server(root) as source:
        loading = threading.Thread(target=served.agent.load, args=("ad-held", source.url("hold", "ad-a")))
        loading.start()
        try:
            wait_until(lambda: source.holding == 1, what="the download to be held")
            assert request(served, "GET", "/health", token=None).status == 200
            assert "ad-held" not in {m.id for m in client.models.list().data}
            assert client.completions.create(model="ad-a", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
            assert request(served, "GET", "/metrics", token=None).status == 200
            assert loading.is_alive() and source.holding == 1, "the load was pending all along"
        finally:
            source.release.set()
            loading.join(timeout=120)
    try:
        assert "ad-held" in {m.id for m in client.models.list().data}
        assert client.completions.create(model="ad-held", prompt=PROMPT, max_tokens=2).choices[0].text
    finally:
        if served.agent.registry.get("ad-held") is not None:
            served.agent.unload("ad-held")
