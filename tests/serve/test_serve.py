"""``dloom serve`` with real parts: a uvicorn server on 127.0.0.1 (a free port, started and
stopped by the fixtures) answering the official ``openai`` client, on the shipped toy-dllm.

Every served output is compared with decoding the same prompt alone, offline, with a fresh
:class:`~dloom.DiffusionDecoder` of the same settings (greedy: the same tokens whatever else
the batch holds). Blocks of 8 positions (4 per prompt) so that streams have several chunks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import dloom
from dloom.cli.commands import app as cli_app
from dloom.decode.session import DecodeSession
from dloom.errors import ConfigurationError, QueueFullError
from dloom.serve.app import ServeConfig, create_app
from dloom.serve.background import BackgroundServer
from dloom.serve.decoders import DecodeDefaults, DecoderPool
from dloom.serve.metrics import ServerMetrics
from dloom.serve.openai_fields import alternatives, completion_logprobs
from dloom.serve.scheduler import Job, Scheduler
from dloom.serve.text import (
    StreamText,
    Visible,
    held_back,
    tokens_of_text,
    visible_output,
)

MODEL = "toy-dllm"
BLOCK = 8
PROMPTS = ["add 40 20", "sort 29796252137", "rev iprmgsqepy4rxu", "copy eezej spmk", "copy hello world abc"]


@pytest.fixture(scope="module")
def model():
    return dloom.load_model(MODEL)


class Served(BackgroundServer):
    """A running server and clients for it."""

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)


def parse_metrics(text: str) -> dict[str, float]:
    """``{name{labels}: value}`` of a Prometheus exposition text."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


@pytest.fixture(scope="module")
def served(model):
    server = Served(ServeConfig(model, DecodeDefaults(block_length=BLOCK), max_batch_size=16, plain_chat=True))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def metrics_of(served: Served) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{served.url}/metrics").text)


def offline(model, prompt, strategy="quota", params=None, max_tokens=32, cache="none", **settings):
    """Text, counted tokens and NFE of ``prompt`` decoded alone by a fresh decoder."""
    decoder = dloom.DiffusionDecoder(model, strategy, params=params or {}, block_length=BLOCK, cache=cache, **settings)
    result = decoder.generate([prompt])
    tokens = result.token_lists[0][:max_tokens]
    text = model.decode([t for t in tokens if t not in model.eos_token_ids])
    return text, len(tokens), int(result.nfe[0])


# --- the endpoints ---------------------------------------------------------------------


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{served.url}/health").json()
    assert health == {"status": "ok", "model": MODEL, "waiting": 0, "running": 0, "admitted_tokens": 0, "line_tokens": 0}


def test_openapi_documents_the_request_bodies(served):
    """The endpoints read their bodies themselves (off the event loop); /openapi.json still
    describes them."""
    document = httpx.get(f"{served.url}/openapi.json").json()
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
    schemas = document["components"]["schemas"]
    assert {"prompt", "n", "stream_options"} <= set(schemas["CompletionRequest"]["properties"])
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["items"] == {"$ref": "#/components/schemas/ChatMessage"}
    assert "StreamOptions" in schemas and "ChatMessage" in schemas


@pytest.mark.parametrize("strategy, params, cache, guarantee", [
    ("quota", None, "none", "reference process"),
    ("threshold", {"tau": 0.8}, "none", "approximate (of quota)"),
    ("frechet", None, "dual", "bound frechet"),
    ("spiffy+threshold", None, "none", "lossless against threshold"),
    ("spiffy+quota+threshold@select_commit", None, "none", "lossless against threshold"),  # a hook swap
])
def test_a_completion_equals_the_offline_decode(model, client, strategy, params, cache, guarantee):
    prompt = PROMPTS[1]
    response = client.completions.create(
        model=MODEL, prompt=prompt, extra_body={"strategy": strategy, "params": params, "cache": cache},
    )
    text, tokens, nfe = offline(model, prompt, strategy, params, cache=cache)
    assert response.choices[0].text == text and response.choices[0].finish_reason == "stop"
    usage = response.usage
    assert (usage.completion_tokens, usage.prompt_tokens) == (tokens, len(model.encode([prompt])[0]))
    assert usage.nfe == nfe and usage.tokens_per_forward == pytest.approx(tokens / nfe)
    assert usage.guarantee == guarantee and usage.strategy == strategy


def test_several_prompts_and_token_ids_make_one_choice_each(model, client):
    ids = model.encode([PROMPTS[2]])[0]
    response = client.completions.create(model=MODEL, prompt=[PROMPTS[0], PROMPTS[3]])
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [offline(model, p)[0] for p in (PROMPTS[0], PROMPTS[3])]
    assert response.usage.batch_rows == 2  # one request's prompts share a batch
    by_ids = client.completions.create(model=MODEL, prompt=ids)
    assert by_ids.choices[0].text == offline(model, PROMPTS[2])[0]


def test_max_tokens_and_stop_cut_the_output(model, client):
    full = offline(model, PROMPTS[4])[0]
    short = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=5)
    assert short.choices[0].text == full[:5] and short.choices[0].finish_reason == "length"
    assert short.usage.completion_tokens == 5
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[4], stop=["wor", "zzz"])
    assert stopped.choices[0].text == full[: full.index("wor")] and stopped.choices[0].finish_reason == "stop"


def test_a_stop_sequence_cuts_the_usage_and_the_logprobs_with_the_text(model, client):
    """``copy hello world abc`` stopped at ``wor``: 'hello ' is 6 tokens, billed and described
    by the logprobs (tokens, offsets, alternatives), in a plain and a streamed answer."""
    full = offline(model, PROMPTS[4])[0]
    assert full.startswith("hello world")
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[4], stop=["wor"], logprobs=2)
    choice = answer.choices[0]
    assert (choice.text, choice.finish_reason, answer.usage.completion_tokens) == ("hello ", "stop", 6)
    assert choice.logprobs.tokens == list("hello ") and choice.logprobs.text_offset == [0, 1, 2, 3, 4, 5]
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.top_logprobs) == 6
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[4]}], stop=["wor"], logprobs=True, top_logprobs=1,
    )
    assert chat.usage.completion_tokens == len(chat.choices[0].logprobs.content)
    assert "".join(item.token for item in chat.choices[0].logprobs.content) == chat.choices[0].message.content
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[4], stop=["wor"], stream=True,
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "hello "
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1].usage.total_tokens == answer.usage.total_tokens


def test_the_tokens_of_a_cut_text_are_the_fewest_that_make_it():
    pieces = {1: "he", 2: "llo w", 3: "orld", 4: "", 9: "<eos>"}

    def decode(ids):
        return "".join(pieces[t] for t in ids if t != 9)

    assert tokens_of_text((1, 2, 3), 6, {9}, decode) == 2  # "llo w" straddles the cut: it counts
    assert tokens_of_text((1, 2, 3), 0, {9}, decode) == 0
    assert tokens_of_text((1, 9, 4, 2, 3), 7, {9}, decode) == 4
    stopped = visible_output([1, 2, 3, 9], (9,), 32, ["wor"], decode, complete=True)
    assert (stopped.text, stopped.tokens, stopped.finish_reason) == ("hello ", (1, 2), "stop")
    assert visible_output([1, 2, 3, 9], (9,), 32, ["he"], decode, complete=True).tokens == ()
    assert visible_output([1, 2, 3, 9], (9,), 32, ["xyz"], decode, complete=True).tokens == (1, 2, 3, 9)


def test_top_logprobs_keep_ids_with_the_same_text_apart():
    """Two ids that both decode to '' are two entries, each with its own value (a dict keyed
    by text alone kept one, with the less likely value)."""
    texts = {5: "a", 0: "", 1: "", 7: "a"}
    top = alternatives([5, 0, 1, 7], [-0.1, -1.0, -2.0, -3.0], lambda ids: texts[ids[0]])
    assert top == {"a": -0.1, "": -1.0, "token_id:1": -2.0, "token_id:7": -3.0}
    built = completion_logprobs([5], [-0.1], [[5, 0, 1]], [[-0.1, -1.0, -2.0]], lambda ids: texts[ids[0]], 3)
    assert built["top_logprobs"] == [{"a": -0.1, "": -1.0, "token_id:1": -2.0}]


def test_chat_joins_messages_without_a_template(model, client):
    messages = [{"role": "system", "content": "copy"}, {"role": "user", "content": "hello"}]
    response = client.chat.completions.create(model=MODEL, messages=messages)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == offline(model, "copy hello")[0]
    assert response.object == "chat.completion"


def test_chat_uses_the_tokenizer_template_or_refuses_without_one(model):
    refusing = create_app(ServeConfig(model, DecodeDefaults(block_length=BLOCK)))
    with TestClient(refusing) as http:
        answer = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 400 and "no chat template" in answer.json()["error"]["message"]
    templated = dataclasses.replace(model, tokenizer=__import__("copy").deepcopy(model.tokenizer))
    templated.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    with TestClient(create_app(ServeConfig(templated, DecodeDefaults(block_length=BLOCK)))) as http:
        answer = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "copy"}, {"role": "user", "content": "abc"}],
        })
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == offline(model, "copy abc ")[0]


def test_a_stream_sends_each_block_as_it_lands(model, client):
    prompt = PROMPTS[4]
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True},
        extra_body={"strategy": "spiffy+quota"},
    ))
    texts = [c.choices[0].text for c in chunks if c.choices]
    text, tokens, nfe = offline(model, prompt, "spiffy+quota")
    assert "".join(texts) == text
    assert len([t for t in texts if t]) >= 2  # 17 characters over blocks of 8
    assert all(len(t) <= BLOCK for t in texts)
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.nfe == nfe


def test_a_chat_stream_starts_with_the_role(model, client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[4]}], stream=True,
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == offline(model, PROMPTS[4])[0]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stream_holds_back_text_that_may_begin_a_stop_sequence(model, client):
    full = offline(model, PROMPTS[4])[0]  # 'hello wo' is block 0's text, 'rld abc' block 1's
    assert full.startswith("hello wo")
    texts = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[4], stream=True, stop="wor",
    )]
    assert "".join(texts) == "hello " and not any("w" in t for t in texts)


def test_seeded_sampling_served_alone_equals_the_offline_decode(model, client):
    settings = {"temperature": 3.0, "seed": 7}  # hot enough that seeds disagree on the toy model
    answers = [client.completions.create(model=MODEL, prompt=PROMPTS[3], **settings) for _ in range(2)]
    text = offline(model, PROMPTS[3], **settings)[0]
    assert [a.choices[0].text for a in answers] == [text, text]
    other = offline(model, PROMPTS[3], temperature=3.0, seed=8)[0]
    assert other != text  # the seed matters, so the equality above is not vacuous


BAD_REQUESTS = [
    ({"extra_body": {"strategy": "nope"}}, 400, "unknown strategy 'nope'; known strategies"),
    ({"extra_body": {"strategy": "threshold", "params": {"tau": 3}}}, 400, "parameter 'tau' of strategy 'threshold'"),
    ({"extra_body": {"params": {"tau": 0.5}}}, 400, "unknown parameter 'tau' for strategy 'quota'"),
    ({"extra_body": {"cache": "weird"}}, 400, "cache is 'weird'; allowed: none, prefix, dual"),
    ({"extra_body": {"strategy": "spiffy", "cache": "prefix", "cache_refresh": 2}}, 400, "cache_refresh=2 applies to plain steps"),
    ({"extra_body": {"strategy": "failfast"}}, 400, "strategy 'failfast' runs in the ar-target decoder, but the models here are a dLLM"),
    ({"max_tokens": 33}, 400, "max_tokens 33 exceeds the 32 positions"),
    ({"max_tokens": 0}, 422, "max_tokens: Input should be greater than or equal to 1"),
    ({"temperature": -1}, 422, "temperature: Input should be greater than or equal to 0"),
    ({"n": 17}, 422, "n: Input should be less than or equal to 16"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 422, "5 stop sequences given; allowed: at most 4"),
    ({"extra_body": {"top_k": 5}}, 422, "top_k: Extra inputs are not permitted"),
    ({"prompt": ""}, 400, "prompt 0 is empty"),
    ({"prompt": [5, 999]}, 400, "token id 999; allowed: 0..56"),
    ({"prompt": [[5, 6], [1, 1, 1]]}, 400, "prompt 1 is made only of the mask token (id 1)"),
    ({"prompt": "copy\nab"}, 400, "the model's tokenizer cannot encode the prompt"),
    ({"prompt": "copy " + "a" * 100}, 400, "exceeds the model's context of 128 tokens; dloom refuses it rather than truncate"),
    ({"model": "gpt-4"}, 404, "model 'gpt-4' is not served here"),
]


@pytest.mark.parametrize("overrides, status, words", BAD_REQUESTS, ids=[w for _, _, w in BAD_REQUESTS])
def test_a_bad_request_is_refused_with_a_clear_message(served, client, overrides, status, words):
    before = metrics_of(served)['dloom_requests_total{outcome="invalid"}']
    request = {"model": MODEL, "prompt": PROMPTS[0], **overrides}
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(**request)
    assert raised.value.status_code == status
    assert words in str(raised.value)
    assert metrics_of(served)['dloom_requests_total{outcome="invalid"}'] == before + 1
    assert metrics_of(served)["dloom_admitted_tokens"] == 0  # nothing was queued


def test_a_bad_chat_request_is_refused(client):
    with pytest.raises(openai.UnprocessableEntityError, match="messages: List should have at least 1 item"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.UnprocessableEntityError, match="messages.0.role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])


def test_metrics_count_requests_tokens_and_forwards(served, client):
    before = metrics_of(served)
    answer = client.completions.create(model=MODEL, prompt=[PROMPTS[0], PROMPTS[2]], extra_body={"strategy": "threshold"})
    after = metrics_of(served)
    assert after['dloom_requests_total{outcome="completed"}'] == before['dloom_requests_total{outcome="completed"}'] + 1
    assert after["dloom_generated_tokens_total"] - before["dloom_generated_tokens_total"] == answer.usage.completion_tokens
    assert after["dloom_prompt_tokens_total"] - before["dloom_prompt_tokens_total"] == answer.usage.prompt_tokens
    assert after["dloom_nfe_total"] - before["dloom_nfe_total"] == answer.usage.nfe
    assert after["dloom_batch_rows_total"] - before["dloom_batch_rows_total"] == 2
    assert after["dloom_batches_total"] - before["dloom_batches_total"] == 1
    assert after["dloom_batch_occupancy"] in (1 / 16, 2 / 16)  # its last step: one row, or both
    assert after["dloom_queue_depth"] == 0 and after["dloom_running_rows"] == 0
    text = httpx.get(f"{served.url}/metrics").text
    assert "# TYPE dloom_requests_total counter" in text and "# TYPE dloom_queue_depth gauge" in text


# --- concurrency -----------------------------------------------------------------------


def test_concurrent_clients_each_get_their_own_offline_output(model, served):
    """40 simultaneous clients over four lanes and varied prompts and max_tokens: nothing is
    lost or duplicated, rows are batched, and every output equals its offline decode."""
    strategies = [("quota", None), ("threshold", {"tau": 0.8}), ("spiffy+threshold", None), ("factor", None)]
    cases = [
        (PROMPTS[i % len(PROMPTS)] + " " * (i % 3), *strategies[i % len(strategies)], (8, 16, 32)[i % 3])
        for i in range(40)
    ]
    expected = [offline(model, p, s, params, max_tokens=m)[0] for p, s, params, m in cases]
    before = metrics_of(served)
    start = threading.Barrier(len(cases))
    client = served.client()

    def ask(case):
        prompt, strategy, params, max_tokens = case
        start.wait()
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body={"strategy": strategy, "params": params},
        )

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases))
    assert [a.choices[0].text for a in answers] == expected
    assert len({a.id for a in answers}) == len(cases)
    after = metrics_of(served)
    assert after["dloom_batch_rows_total"] - before["dloom_batch_rows_total"] == len(cases)  # each row decoded once
    assert after["dloom_batches_total"] - before["dloom_batches_total"] < len(cases)  # and batched
    assert max(a.usage.batch_rows for a in answers) > 1
    assert after['dloom_requests_total{outcome="completed"}'] - before['dloom_requests_total{outcome="completed"}'] == len(cases)


SEEDED = {"temperature": 3.0, "seed": 11}  # hot enough that random streams disagree on the toy model
SEEDED_REQUESTS = [PROMPTS[3], PROMPTS[0], [PROMPTS[1], PROMPTS[4], PROMPTS[3]], PROMPTS[2], PROMPTS[3]]


def offline_request(model, prompts):
    """The texts of one request's ``prompts`` decoded together offline, seeded as ``SEEDED``."""
    decoder = dloom.DiffusionDecoder(model, "quota", block_length=BLOCK, **SEEDED)
    lists = decoder.generate(prompts if isinstance(prompts, list) else [prompts]).token_lists
    return [model.decode([t for t in tokens if t not in model.eos_token_ids]) for tokens in lists]


def serve_seeded_together(model):
    """``SEEDED_REQUESTS`` sent at once to a fresh server whose worker starts only when all
    their rows are queued: each request's texts, and the batches the server decoded."""
    rows = sum(len(p) if isinstance(p, list) else 1 for p in SEEDED_REQUESTS)
    served = Served(ServeConfig(model, DecodeDefaults(block_length=BLOCK), max_batch_size=16))
    try:
        served.service.scheduler.stop()  # rows stay queued until all have arrived
        client = served.client()
        with ThreadPoolExecutor(len(SEEDED_REQUESTS)) as pool:
            futures = [
                pool.submit(client.completions.create, model=MODEL, prompt=prompt, **SEEDED)
                for prompt in SEEDED_REQUESTS
            ]
            try:
                wait_for(lambda: metrics_of(served)["dloom_queue_depth"] == rows)
            finally:
                served.service.scheduler.start()  # else the waiting clients would hang
            answers = [future.result() for future in futures]
        batches = metrics_of(served)["dloom_batches_total"]
    finally:
        served.stop()
    texts = [[choice.text for choice in sorted(a.choices, key=lambda c: c.index)] for a in answers]
    return texts, batches


def test_seeded_sampled_requests_share_a_batch_and_each_equals_its_offline_decode(model):
    """Requests with the same seed share one lane and one batch; each row samples from the
    stream of its index in its own request, so every request decodes as it does alone."""
    texts, batches = serve_seeded_together(model)
    assert batches < len(SEEDED_REQUESTS)  # batched together (one batch here)
    assert texts == [offline_request(model, prompts) for prompts in SEEDED_REQUESTS]


def test_seeded_batching_with_the_batch_row_as_random_stream_is_caught(model, monkeypatch):
    """Negative control: streams keyed to the row of the batch instead of the index in the
    request change the samples, and the comparison above sees it."""
    admit = DecodeSession.admit

    def by_batch_row(self, prompts, *args, row_offset=0, **kwargs):
        return admit(self, prompts, *args, row_offset=self._next_id, **kwargs)  # row i: stream i

    monkeypatch.setattr(DecodeSession, "admit", by_batch_row)
    texts, batches = serve_seeded_together(model)
    monkeypatch.undo()
    assert batches < len(SEEDED_REQUESTS)
    expected = [offline_request(model, prompts) for prompts in SEEDED_REQUESTS]
    assert texts != expected


# --- back-pressure and cancellation ----------------------------------------------------


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_a_full_queue_answers_429_and_a_client_that_leaves_frees_its_place(model):
    """With the worker paused and no line, one request fills the token budget: the next gets 429; when
    the first client disconnects its queued row leaves and frees the budget."""
    cost = len(model.encode([PROMPTS[0]])[0]) + 32
    served = Served(ServeConfig(model, DecodeDefaults(block_length=BLOCK), max_queued_tokens=cost, max_waiting_tokens=0))
    try:
        served.service.scheduler.stop()  # rows stay queued
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": PROMPTS[0], "stream": True}) as waiting:
            assert waiting.status_code == 200
            wait_for(lambda: metrics_of(served)["dloom_queue_depth"] == 1)
            with pytest.raises(openai.RateLimitError, match="the server is full"):
                served.client().completions.create(model=MODEL, prompt=PROMPTS[0])
        wait_for(lambda: metrics_of(served)["dloom_queue_depth"] == 0)
        after = metrics_of(served)
        assert after['dloom_cancelled_rows_total{stage="queued"}'] == 1 and after["dloom_admitted_tokens"] == 0
        assert after['dloom_requests_total{outcome="rejected"}'] == 1
        assert after["dloom_batches_total"] == 0  # the cancelled row was never decoded
        served.service.scheduler.start()
        answer = served.client().completions.create(model=MODEL, prompt=PROMPTS[0])
        assert answer.choices[0].text == offline(model, PROMPTS[0])[0]
        with pytest.raises(openai.BadRequestError, match="more than the server's whole budget"):
            served.client().completions.create(model=MODEL, prompt=[PROMPTS[0], PROMPTS[0]])
    finally:
        served.stop()


class SlowForward(torch.nn.Module):
    """The toy model, 150 ms slower per forward, so that a stream is still decoding when its
    client leaves (block 1 takes 1.2 s; the server notices a disconnect within 0.5 s)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **inputs):
        time.sleep(0.15)
        return self.inner(**inputs)


def test_the_line_is_first_come_first_served_so_a_large_request_is_not_overtaken(model):
    """Budget 120, gen_length 32: a small request (34 tokens) is admitted, a large one (102)
    waits in line, and a small one after it waits behind it although it would fit; freeing
    room admits the large one first. Beyond the line's budget: 429."""
    scheduler = Scheduler(32, max_batch_size=4, max_tokens=120, metrics=ServerMetrics(4), max_waiting_tokens=140)
    resolved = DecoderPool(model, DecodeDefaults(block_length=BLOCK)).default

    def request(rows):
        jobs = [Job([5, 6], False, lambda event: None, index=i) for i in range(rows)]
        scheduler.submit(resolved, jobs)
        return jobs

    first = request(1)
    large = request(3)
    late = request(1)
    assert [j.state for j in first + large + late] == ["queued", "waiting", "waiting", "waiting", "waiting"]
    assert scheduler.load() == {"waiting": 5, "running": 0, "admitted_tokens": 34, "line_tokens": 136}
    with pytest.raises(QueueFullError, match="34 of 120 tokens are admitted, 136 of 140 wait in line, and the request needs 34"):
        request(1)
    scheduler.cancel(first[0])  # room for the large request: it goes first, the late one still waits
    assert [j.state for j in large + late] == ["queued"] * 3 + ["waiting"]
    assert scheduler.load()["admitted_tokens"] == 102 and scheduler.load()["line_tokens"] == 34
    scheduler.cancel(late[0])
    assert scheduler.load() == {"waiting": 3, "running": 0, "admitted_tokens": 102, "line_tokens": 0}


def test_a_request_beyond_the_budget_waits_in_line_and_is_answered(model):
    """With the worker paused, one request fills the budget; the next, larger than the room
    left, waits in line (no 429) and gets its offline answer once the worker runs."""
    cost = len(model.encode([PROMPTS[0]])[0]) + 32
    served = Served(ServeConfig(model, DecodeDefaults(block_length=BLOCK), max_queued_tokens=2 * cost))
    try:
        served.service.scheduler.stop()
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(served.client().completions.create, model=MODEL, prompt=PROMPTS[0])
            wait_for(lambda: metrics_of(served)["dloom_admitted_tokens"] == cost)
            second = pool.submit(served.client().completions.create, model=MODEL, prompt=PROMPTS[0], n=2)
            wait_for(lambda: metrics_of(served)["dloom_line_tokens"] == 2 * cost)
            served.service.scheduler.start()
            assert first.result().choices[0].text == offline(model, PROMPTS[0])[0]
            assert [c.text for c in second.result().choices] == [offline(model, PROMPTS[0])[0]] * 2
        assert metrics_of(served)['dloom_requests_total{outcome="rejected"}'] == 0
    finally:
        served.stop()


def test_a_client_leaving_mid_stream_is_discarded_and_the_server_goes_on(model):
    slow = dataclasses.replace(model, model=SlowForward(model.model))
    served = Served(ServeConfig(slow, DecodeDefaults(block_length=BLOCK)))
    try:
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": PROMPTS[4], "stream": True}) as stream:
            first = next(line for line in stream.iter_lines() if line.startswith("data:"))
            assert '"text": "hello wo"' in first  # block 0 landed; blocks 1-3 are decoding
        wait_for(lambda: metrics_of(served)['dloom_requests_total{outcome="cancelled"}'] == 1)
        wait_for(lambda: metrics_of(served)["dloom_admitted_tokens"] == 0)
        after = metrics_of(served)
        assert after['dloom_cancelled_rows_total{stage="running"}'] == 1
        assert after['dloom_requests_total{outcome="completed"}'] == 0
        answer = served.client().completions.create(model=MODEL, prompt=PROMPTS[4])
        assert answer.choices[0].text == offline(model, PROMPTS[4])[0]
    finally:
        served.stop()


def data_lines(stream):
    """The data lines of a server-sent stream, as they arrive."""
    return (line for line in stream.iter_lines() if line.startswith("data:"))


def test_a_request_joins_the_running_batch_of_another(model):
    """A request that arrives while another one decodes joins its batch at the next step
    (request-level batching would make it wait for that batch to end): one running batch
    decodes both, each as it decodes alone."""
    slow = dataclasses.replace(model, model=SlowForward(model.model))
    served = Served(ServeConfig(slow, DecodeDefaults(block_length=BLOCK)))
    try:
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": PROMPTS[4], "stream": True}) as first:
            lines = data_lines(first)
            assert '"text": "hello wo"' in next(lines)  # blocks 1-3 are decoding
            joining = served.client().completions.create(model=MODEL, prompt=PROMPTS[0])
            rest = list(lines)
        assert joining.choices[0].text == offline(model, PROMPTS[0])[0]
        assert joining.usage.batch_rows == 2 and joining.usage.nfe == offline(model, PROMPTS[0])[2]
        assert rest[-1] == "data: [DONE]"
        after = metrics_of(served)
        assert after["dloom_joined_rows_total"] == 1 and after["dloom_batches_total"] == 1
        assert after["dloom_batch_rows_total"] == 2
    finally:
        served.stop()


def test_a_stream_cancelled_mid_batch_frees_its_row_while_the_batch_goes_on(model):
    """A streaming client leaves while another request shares its batch: its row and tokens
    are freed at the next step, while the other row is still decoding in the same batch."""
    slow = dataclasses.replace(model, model=SlowForward(model.model))
    served = Served(ServeConfig(slow, DecodeDefaults(block_length=BLOCK)))
    cost = len(model.encode([PROMPTS[3]])[0]) + 32
    try:
        with ThreadPoolExecutor(1) as pool:
            with httpx.stream("POST", f"{served.url}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": PROMPTS[4], "stream": True}) as leaving:
                lines = data_lines(leaving)  # kept: closing the generator would close the stream
                next(lines)
                staying = pool.submit(served.client().completions.create, model=MODEL, prompt=PROMPTS[3])
                wait_for(lambda: metrics_of(served)["dloom_running_rows"] == 2)  # it joined the batch
            wait_for(lambda: metrics_of(served)["dloom_admitted_tokens"] == cost)
            assert not staying.done()  # the batch goes on: the row left it before it ended
            after = metrics_of(served)
            assert after["dloom_running_rows"] == 1 and after['dloom_cancelled_rows_total{stage="running"}'] == 1
            assert staying.result().choices[0].text == offline(model, PROMPTS[3])[0]
        assert metrics_of(served)["dloom_batches_total"] == 1
    finally:
        served.stop()


class FailingForward(torch.nn.Module):
    """A model whose forward raises, as a broken checkpoint or an out-of-memory would."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **inputs):
        raise RuntimeError("the device is on fire")


def test_a_failing_decode_answers_500_and_the_server_goes_on(model):
    broken = dataclasses.replace(model, model=FailingForward(model.model))
    served = Served(ServeConfig(broken, DecodeDefaults(block_length=BLOCK)))
    try:
        with pytest.raises(openai.InternalServerError, match="decoding failed: the device is on fire"):
            served.client().completions.create(model=MODEL, prompt=PROMPTS[0])
        with pytest.raises(openai.APIError, match="decoding failed: the device is on fire"):
            list(served.client().completions.create(model=MODEL, prompt=PROMPTS[0], stream=True))
        after = metrics_of(served)
        assert after['dloom_requests_total{outcome="failed"}'] == 2 and after["dloom_admitted_tokens"] == 0
    finally:
        served.stop()


@contextlib.contextmanager
def serve_process(*args: str) -> Iterator[openai.OpenAI]:
    """``dloom serve ARGS`` in a process of its own on a free port, once it answers
    ``/health``: an openai client of it. The process is stopped on leaving."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-c", "from dloom.cli.commands import app; app()", "serve", "--port", str(port), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert process.poll() is None, process.stderr.read()
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, seconds=60)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    finally:
        process.terminate()
        process.wait(timeout=30)


# --- the command line ----------------------------------------------------------------


@pytest.mark.slow  # a fresh process imports torch and loads the model: 10-20 s
def test_dloom_serve_runs_the_server(model):
    """``dloom serve`` in its own process answers on the port it was given."""
    with serve_process("--block-length", str(BLOCK), "--strategy", "threshold") as client:
        answer = client.completions.create(model=MODEL, prompt=PROMPTS[0])
    assert answer.choices[0].text == offline(model, PROMPTS[0], "threshold")[0]
    assert answer.usage.strategy == "threshold"


def cli_generate(*args: str) -> dict:
    """The one row of ``dloom generate --json ARGS``."""
    result = CliRunner().invoke(cli_app, ["generate", "--json", *args])
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    return row


FAILFAST_PROMPT = "add 25 17"


def test_failfast_is_served_with_the_output_of_the_cli():
    """An AR-target strategy is served on the models the factory loads for it (the AR target
    answers, the dLLM drafts), with the tokens ``dloom generate`` decodes."""
    from dloom.factory import select_models

    models = select_models(None, "failfast").load()
    config = ServeConfig(models.model, DecodeDefaults(strategy="failfast"), drafter=models.drafter)
    with Served(config) as server:
        client = server.client()
        answer = client.completions.create(model="toy-ar", prompt=FAILFAST_PROMPT)
        streamed = client.completions.create(model="toy-ar", prompt=FAILFAST_PROMPT, stream=True)
        streamed_text = "".join(chunk.choices[0].text for chunk in streamed)
        with pytest.raises(openai.BadRequestError, match="ignore_eos is not supported with strategy 'failfast'"):
            client.completions.create(model="toy-ar", prompt=FAILFAST_PROMPT, extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError, match="strategy 'quota' runs in the diffusion decoder"):
            client.completions.create(model="toy-ar", prompt=FAILFAST_PROMPT, extra_body={"strategy": "quota"})
    row = cli_generate("--strategy", "failfast", FAILFAST_PROMPT)
    assert answer.choices[0].text == streamed_text == row["text"] != ""
    assert answer.usage.completion_tokens == len(row["tokens"]) and answer.usage.nfe == row["nfe"]
    assert answer.usage.strategy == "failfast" and answer.usage.guarantee == "lossless against the AR target toy-ar"


@pytest.mark.slow  # a fresh process imports torch and loads two models: 10-20 s
def test_dloom_serve_serves_failfast_with_the_output_of_the_cli():
    """``dloom serve --strategy failfast`` in its own process answers the openai client with
    the text ``dloom generate --strategy failfast`` prints."""
    with serve_process("--strategy", "failfast", "--target", "toy-ar", "--drafter", "toy-dllm") as client:
        answer = client.completions.create(model="toy-ar", prompt=FAILFAST_PROMPT)
    assert answer.choices[0].text == cli_generate("--strategy", "failfast", FAILFAST_PROMPT)["text"] != ""
    assert answer.usage.strategy == "failfast"


def test_a_hook_swap_is_a_server_default(model):
    """The server's default strategy is read by the one spec parser, ``NAME@HOOK`` included."""
    pool = DecoderPool(model, DecodeDefaults(strategy="spiffy+quota+threshold@select_commit", block_length=BLOCK))
    assert pool.default.decoder.composition.provider("dloom_select_commit") == "threshold"


def test_dloom_serve_refuses_bad_defaults_before_it_listens():
    result = CliRunner().invoke(cli_app, ["serve", "--strategy", "nope"])
    assert result.exit_code == 2 and "unknown strategy 'nope'" in result.output


# --- the pieces, without HTTP ----------------------------------------------------------


@pytest.mark.parametrize("strategy", ["quota", "threshold", "spiffy+threshold"])
def test_on_block_hands_over_every_decoded_block_of_every_row(model, strategy):
    """The engine callback streams rely on: each row's blocks, in order, are its generated
    tokens (up to the block where it finished), plain and speculative alike."""
    decoder = dloom.DiffusionDecoder(model, strategy, block_length=BLOCK)
    seen = {}

    def on_block(record):
        for row, block, tokens, new in zip(
            record.rows.tolist(), record.blocks.tolist(), record.tokens.tolist(), record.generated.tolist()
        ):
            assert len(seen.setdefault(row, [])) == block * BLOCK  # no block skipped or repeated
            assert all(new)  # prompt-aligned blocks hold generated positions only
            seen[row].extend(tokens)

    result = decoder.generate(PROMPTS, on_block=on_block)
    for row, tokens in enumerate(result.token_lists):
        assert seen[row][: len(tokens)] == tokens
        assert len(seen[row]) == -(-len(tokens) // BLOCK) * BLOCK  # nothing after the finishing block


def test_the_scheduler_admits_within_its_budget_and_frees_a_cancelled_row(model):
    pool = DecoderPool(model, DecodeDefaults(block_length=BLOCK))
    scheduler = Scheduler(32, max_batch_size=4, max_tokens=100, metrics=ServerMetrics(4))
    job = lambda: Job([5, 6, 7], stream=False, post=lambda event: None)  # noqa: E731 - costs 35
    first, second = job(), job()
    scheduler.submit(pool.default, [first, second])
    with pytest.raises(QueueFullError, match="70 of 100 tokens are admitted and the request needs 35"):
        scheduler.submit(pool.default, [job()])
    scheduler.cancel(first)
    assert first.state == "cancelled" and scheduler.load() == {"waiting": 1, "running": 0, "admitted_tokens": 35, "line_tokens": 0}
    scheduler.submit(pool.default, [job()])
    with pytest.raises(ConfigurationError, match="more than the server's whole budget of 100"):
        scheduler.submit(pool.default, [job(), job(), job()])


def test_equivalent_settings_share_a_lane_and_a_seed_only_matters_when_sampling(model):
    pool = DecoderPool(model, DecodeDefaults(strategy="threshold"))
    assert pool.resolve(params={"tau": 0.7}).key == pool.resolve().key  # 0.7 is the default
    assert pool.resolve(params={"tau": 0.8}).key != pool.resolve().key
    assert pool.resolve(seed=3).key == pool.resolve(seed=4).key  # greedy: the seed changes nothing
    sampled = pool.resolve(temperature=1.0, seed=3)
    assert sampled.key == pool.resolve(temperature=1.0, seed=3).key  # same seed: one lane
    assert sampled.key != pool.resolve(temperature=1.0, seed=4).key
    assert sampled.key != pool.resolve(temperature=1.0).key


def test_visible_output_cuts_at_eos_max_tokens_and_stop(model):
    ids = model.encode(["hello world"])[0] + [2, 1, 1]
    decode = model.decode
    assert visible_output(ids, (2,), 32, [], decode, complete=False).finish_reason == "stop"
    cut = visible_output(ids, (2,), 5, [], decode, complete=True)
    assert (cut.text, cut.finish_reason, len(cut.tokens)) == ("hello", "length", 5)
    stopped = visible_output(ids, (2,), 32, ["o w"], decode, complete=True)
    assert (stopped.text, stopped.finish_reason) == ("hell", "stop")
    assert visible_output(ids[:4], (2,), 32, [], decode, complete=False).finish_reason is None


def test_held_back_text_is_the_longest_suffix_beginning_a_stop_sequence():
    assert held_back("hello wo", ["wor"]) == 2
    assert held_back("hello w", ["xyz", "wor"]) == 1
    assert held_back("hello", ["wor"]) == 0
    assert held_back("caf\ufffd", []) == 1
    stream = StreamText(["wor"])
    assert stream.advance(Visible("ab wo", (), None)) == "ab "  # "wo" may begin "wor"
    assert stream.advance(Visible("ab wonder", (), None)) == "wonder"
    assert stream.advance(Visible("ab wonder", (), "stop")) == ""
