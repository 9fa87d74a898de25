"""``dloom serve`` against hostile clients and plugins, on a real uvicorn server (loopback).

Each row names the exact status code and words of the answer, checks that it is OpenAI's
error object and that ``/metrics`` counted its outcome. A hook raising ``SystemExit`` or
``KeyboardInterrupt`` fails its own batch only; oversized bodies, texts and stop sequences
are refused before any work; a request never names a server path; types are strict.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from typer.testing import CliRunner

import dloom
from dloom.cli.commands import app as cli_app
from dloom.errors import ConfigurationError, HTTPError, QueueFullError
from dloom.hooks.registry import Strategy, get_registry
from dloom.serve.app import ServeConfig, create_app
from dloom.serve.background import BackgroundServer
from dloom.serve.body import least_token_rows
from dloom.serve.decoders import DecodeDefaults, DecoderPool
from dloom.serve.files import ServerFiles
from dloom.serve.limits import MAX_BODY_BYTES, MAX_HEADER_BYTES
from dloom.serve.metrics import ServerMetrics
from dloom.serve.scheduler import Job, Scheduler
from dloom.serve.schemas import CompletionRequest
from dloom.serve.service import Service
from dloom.types import Parameter
from dloom_plugins.spiffy.graph import BUILTIN_DIR

MODEL = "toy-dllm"
BLOCK = 8
PROMPTS = ["add 40 20", "sort 29796252137", "rev iprmgsqepy4rxu", "copy eezej spmk", "copy hello world abc"]
BODY_LIMIT = 1 << 20  # the module server's, small so that oversized bodies are cheap to send
GRAPH = "toy-dllm__quota__b8.json"  # a built-in graph, offered by the operator under another name


@pytest.fixture(scope="module")
def model():
    return dloom.load_model(MODEL)


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("graphs")
    shutil.copy(BUILTIN_DIR / GRAPH, directory / "offered.json")
    return directory


@pytest.fixture(scope="module")
def served(model, graph_dir):
    config = ServeConfig(
        model, DecodeDefaults(block_length=BLOCK), plain_chat=True, max_body_bytes=BODY_LIMIT,
        graph_dirs=(str(graph_dir),),
    )
    with BackgroundServer(config) as server:
        yield server


def client_of(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def metrics_of(server: BackgroundServer) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def outcome(server: BackgroundServer, name: str) -> float:
    return metrics_of(server)[f'dloom_requests_total{{outcome="{name}"}}']


def offline(model, prompt, strategy="quota", params=None):
    """The text of ``prompt`` decoded alone by a fresh decoder."""
    result = dloom.DiffusionDecoder(model, strategy, params=params or {}, block_length=BLOCK).generate([prompt])
    return model.decode([t for t in result.token_lists[0] if t not in model.eos_token_ids])


def assert_error_object(answer: httpx.Response, status: int, words: str) -> dict:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error["message"]
    return error


# --- strict types, limits and server files: one row per hostile body --------------------

HOSTILE_BODIES = [
    ({"prompt": [True, 3, 4]}, 422, "prompt: got [True, 3, 4]; allowed: str | list[str] | list[int] | list[list[int]]"),
    ({"prompt": [[5, 6], [7, 1.0]]}, 422, "allowed: str | list[str] | list[int] | list[list[int]]"),
    ({"params": {"tau": [0.5]}}, 422, "params.tau: got [0.5]; allowed: bool | int | float | str"),
    ({"stream": "yes"}, 422, "stream: Input should be a valid boolean"),
    ({"max_tokens": 4.0}, 422, "max_tokens: Input should be a valid integer"),
    ({"seed": True, "temperature": 1.0}, 422, "seed: Input should be a valid integer"),
    ({"strategy": "spiffy", "params": {"spiffy.budget": 2.7}}, 400,
     "parameter 'budget' of strategy 'spiffy' must be a int, got 2.7; allowed: [0, inf)"),
    ({"strategy": "threshold", "params": {"tau": True}}, 400,
     "parameter 'tau' of strategy 'threshold' must be a float, got True"),
    ({"strategy": "spiffy", "params": {"layout": 1}}, 400, "parameter 'layout' of strategy 'spiffy' must be a str, got 1"),
    ({"cache": "prefix", "cache_refresh": 1e21}, 422, "cache_refresh: Input should be a valid integer"),
    ({"cache": "prefix", "cache_refresh": 10**21}, 422, "cache_refresh: Input should be less than or equal to 1048576"),
    ({"stop": "x" * 257}, 400, "stop sequence 0 has 257 characters; allowed: at most 256"),
    ({"stop": ["ok", "y" * 10_000]}, 400, "stop sequence 1 has 10000 characters; allowed: at most 256"),
    ({"prompt": "a" * 900_000}, 400,
     "prompt 0 has 900000 characters; allowed: at most 576 (the model's context of 128 tokens minus gen_length 32, "
     "at most 6 characters per token of this tokenizer)"),
    ({"prompt": ["add 1 2", "b" * 600]}, 400, "prompt 1 has 600 characters; allowed: at most 576"),
    ({"strategy": "spiffy", "params": {"spiffy.graph": "/dev/zero"}}, 400,
     "parameter 'spiffy.graph' is '/dev/zero'; a request may not name a path on the server, only one of the files "
     "this server offers: 'offered.json', 'toy-dllm__factor-1__b32.json', "),
    ({"strategy": "spiffy+threshold", "params": {"graph": "../offered.json"}}, 400,
     "parameter 'graph' is '../offered.json'; a request may not name a path on the server"),
    ({"strategy": "spiffy", "params": {"spiffy.graph": 5}}, 400,
     "parameter 'spiffy.graph' is 5; a request may not name a path on the server"),
]


@pytest.mark.parametrize("overrides, status, words", HOSTILE_BODIES, ids=[w[:60] for _, _, w in HOSTILE_BODIES])
def test_a_hostile_body_is_refused_before_any_work(served, overrides, status, words):
    before = outcome(served, "invalid")
    answer = httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], **overrides}, timeout=30)
    error = assert_error_object(answer, status, words)
    assert error["type"] == "invalid_request_error"
    assert outcome(served, "invalid") == before + 1
    assert metrics_of(served)["dloom_admitted_tokens"] == 0  # nothing was queued


def test_a_path_refusal_says_nothing_about_the_server_files(served):
    """An existing file, a missing one and a directory get the same words: the value is
    compared with the offered names, never looked up."""
    messages = []
    for path in ("/etc/hostname", "/no/such/file.json", "/tmp", str(Path(__file__))):
        answer = httpx.post(f"{served.url}/v1/completions", json={
            "model": MODEL, "prompt": PROMPTS[0], "strategy": "spiffy", "params": {"spiffy.graph": path},
        })
        messages.append(assert_error_object(answer, 400, "may not name a path")["message"].replace(repr(path), "PATH"))
    assert len(set(messages)) == 1


@pytest.mark.parametrize("name", ["offered.json", GRAPH])
def test_an_offered_or_built_in_graph_is_named_by_its_file_name(model, served, graph_dir, name):
    path = graph_dir / name if name == "offered.json" else BUILTIN_DIR / name
    answer = client_of(served).completions.create(
        model=MODEL, prompt=PROMPTS[4], extra_body={"strategy": "spiffy+quota", "params": {"spiffy.graph": name}},
    )
    assert answer.choices[0].text == offline(model, PROMPTS[4], "spiffy+quota", {"graph": str(path)})


def test_any_strategys_path_parameter_is_guarded_not_only_spiffys(tmp_path):
    """The guard reads ``Parameter.path`` from the registry: a plugin's own file parameter
    is refused the same way, and an offered file's name becomes its path."""

    class ReadsAFile:
        def __init__(self, table: str = "") -> None:
            self.table = table

        @dloom.hookimpl
        def dloom_select_commit(self, confidence, selectable, schedule):
            return selectable

    shipped, operators = tmp_path / "shipped", tmp_path / "operators"
    shipped.mkdir(), operators.mkdir()
    (shipped / "builtin.txt").write_text("4 5 6")
    (operators / "table.txt").write_text("1 2 3")
    (shipped / "notes.md").write_text("not a table")
    parameter = Parameter("table", "", str, "a lookup table", path=True, path_files=(str(shipped / "*.txt"),))
    registration = dloom.StrategyRegistration("reads-a-file", ReadsAFile, parameters=(parameter,), guarantee="none")
    get_registry().strategies["reads-a-file"] = Strategy("reads-a-file", "tests", registration)
    files = ServerFiles([operators])
    with pytest.raises(ConfigurationError, match=(
        "parameter 'table' is '/etc/passwd'; a request may not name a path on the server, only one of the files "
        "this server offers: 'table.txt', 'builtin.txt'; or ''"
    )):
        files.resolve("reads-a-file", {"table": "/etc/passwd"})
    assert files.resolve("reads-a-file", {"reads-a-file.table": "table.txt"}) == {"reads-a-file.table": str(operators / "table.txt")}
    assert files.resolve("reads-a-file", {"table": "builtin.txt"}) == {"table": str(shipped / "builtin.txt")}
    assert files.resolve("reads-a-file", {"table": ""}) == {"table": ""}
    assert files.resolve("quota", {}) == {} and files.resolve("quota", None) is None
    for index in range(30):
        (operators / f"t{index:02d}.txt").write_text("")
    with pytest.raises(ConfigurationError, match=r"is '/{76}\.\.\.; .* 't19.txt', and 12 more; or ''"):
        files.resolve("reads-a-file", {"table": "/" * 5000})


def test_parameters_take_cli_strings_and_values_of_their_own_type_only():
    budget, tau, flag = Parameter("budget", 1, int, low=0), Parameter("tau", 0.9, float), Parameter("on", False, bool)
    assert [budget.coerce("3", "s"), tau.coerce("0.5", "s"), flag.coerce("yes", "s")] == [3, 0.5, True]  # the CLI's
    assert [budget.coerce(3, "s"), tau.coerce(1, "s"), flag.coerce(False, "s")] == [3, 1.0, False]
    for parameter, value in ((budget, 2.7), (budget, True), (budget, "2.7"), (tau, True), (flag, 1), (flag, 0.0)):
        with pytest.raises(ConfigurationError, match=f"must be a {parameter.kind.__name__}, got {value!r}"):
            parameter.coerce(value, "s")


# --- the HTTP layer: OpenAI error objects for what FastAPI answers itself ---------------

HTTP_CASES = [
    ("POST", "/v1/completions", {"content": b'{"model": "toy-dllm", "prompt":', "headers": {"content-type": "application/json"}},
     400, "the request body is not valid JSON", "invalid"),
    ("POST", "/v1/completions", {"content": b"[1, 2]", "headers": {"content-type": "application/json"}},
     422, "the request body must be a JSON object", "invalid"),
    ("POST", "/v1/completions", {"content": b'{"model": "\xff"}', "headers": {"content-type": "application/json"}},
     400, "the request body is not UTF-8 (byte 11); allowed: JSON in UTF-8", "invalid"),
    ("POST", "/v1/chat/completions", {"content": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
                                      "headers": {"content-type": "application/json"}},
     400, "the request body is not valid JSON: it nests arrays or objects too deeply", "invalid"),
    ("POST", "/v1/completions", {"content": b'{"model": "toy-dllm", "prompt": "x"}',
                                 "headers": {"content-type": "application/json; charset=latin-1"}},
     400, "the request body is declared as charset 'latin-1'; allowed: JSON in UTF-8", "invalid"),
    ("POST", "/v1/completions", {"content": b'{"model": "toy-dllm", "prompt": "x"}',
                                 "headers": {f"x-{i}": "1" for i in range(95)}},  # and httpx's 6
     431, "the request has 101 headers; allowed: at most 100 (dloom serve --max-headers)", "too_large"),
    ("GET", "/v1/engines", {}, 404, "no endpoint answers GET /v1/engines", "unrouted"),
    ("GET", "/v1/completions", {}, 405, "GET /v1/completions: method GET is not allowed; allowed: POST", "unrouted"),
    ("POST", "/v1/completions", {"content": b"x" * (BODY_LIMIT + 1), "headers": {"content-type": "application/json"}},
     413, f"the request body has {BODY_LIMIT + 1} bytes; allowed: at most {BODY_LIMIT} bytes (dloom serve --max-body-bytes)",
     "too_large"),
    ("POST", "/v1/chat/completions", {"content": (b"y" * 65536 for _ in range(17)), "headers": {"content-type": "application/json"}},
     413, f"the request body passed {BODY_LIMIT} bytes; allowed: at most {BODY_LIMIT} bytes", "too_large"),  # chunked: no length
]


@pytest.mark.parametrize("method, path, sent, status, words, counted", HTTP_CASES, ids=[c[4][:50] for c in HTTP_CASES])
def test_fastapis_own_refusals_are_openai_error_objects_and_counted(served, method, path, sent, status, words, counted):
    before = outcome(served, counted)
    answer = httpx.request(method, f"{served.url}{path}", timeout=30, **sent)
    assert_error_object(answer, status, words)
    assert outcome(served, counted) == before + 1


def test_an_unexpected_error_is_a_500_error_object_and_the_server_goes_on(model, served, monkeypatch):
    def overflowing(*args):
        raise OverflowError("Python int too large to convert to C long")

    before = outcome(served, "failed")
    monkeypatch.setattr(served.service, "prepare", overflowing)
    answer = httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0]})
    error = assert_error_object(answer, 500, "the server failed on this request: OverflowError: Python int too large")
    assert error["type"] == "server_error" and outcome(served, "failed") == before + 1
    monkeypatch.undo()
    assert client_of(served).completions.create(model=MODEL, prompt=PROMPTS[0]).choices[0].text == offline(model, PROMPTS[0])


def test_the_openai_client_reads_the_413_and_422_messages(served):
    client = client_of(served)
    with pytest.raises(openai.APIStatusError, match="allowed: at most 1048576 bytes") as raised:
        client.completions.create(model=MODEL, prompt="z" * BODY_LIMIT)
    assert raised.value.status_code == 413
    with pytest.raises(openai.UnprocessableEntityError, match="stream_options.include_usage: Input should be a valid boolean"):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], extra_body={"stream_options": {"include_usage": "yes"}})


def test_huge_prompts_at_once_are_refused_fast_and_the_server_goes_on(model, served):
    """Three near-limit texts at once, as completions and as a chat: each refused before
    tokenizing (the tokenizer's own count would say 'exceeds the model's context'), quickly,
    and the server answers the next request."""
    text = "copy " * (BODY_LIMIT // 6)
    bodies = [
        ("/v1/completions", {"model": MODEL, "prompt": text}),
        ("/v1/completions", {"model": MODEL, "prompt": [PROMPTS[0], text]}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}]}),
    ]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: httpx.post(f"{served.url}{b[0]}", json=b[1], timeout=30), bodies))
    seconds = time.perf_counter() - started
    for answer, index in zip(answers, (0, 1, 0)):
        assert_error_object(answer, 400, f"prompt {index} has ")
        assert "characters; allowed: at most 576" in answer.json()["error"]["message"]
    assert seconds < 10, f"refusing three big texts took {seconds:.1f} s"
    assert client_of(served).completions.create(model=MODEL, prompt=PROMPTS[0]).choices[0].text == offline(model, PROMPTS[0])


def test_a_chat_templates_raise_exception_is_a_400_with_its_message(model):
    templated = dataclasses.replace(model, tokenizer=__import__("copy").deepcopy(model.tokenizer))
    templated.tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('system messages are not supported by this template') }}"
        "{% endif %}{{ m['content'] }} {% endfor %}"
    )
    with BackgroundServer(ServeConfig(templated, DecodeDefaults(block_length=BLOCK))) as server:
        client = client_of(server)
        with pytest.raises(openai.BadRequestError, match=(
            "the model's chat template refused the conversation: system messages are not supported by this template"
        )):
            client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "x"}])
        assert outcome(server, "invalid") == 1 and outcome(server, "failed") == 0
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "copy abc"}])
        assert answer.choices[0].message.content == offline(model, "copy abc ")


# --- hooks that raise SystemExit or KeyboardInterrupt ----------------------------------


def hostile(name: str, error: BaseException, hook: str = "dloom_select_commit") -> None:
    """Register strategy ``name``: a commit rule whose ``hook`` raises ``error``."""

    class Hostile:
        @dloom.hookimpl
        def dloom_select_commit(self, confidence, selectable, schedule):
            if hook == "dloom_select_commit":
                raise error
            return torch.zeros_like(selectable)

        @dloom.hookimpl
        def dloom_configure(self, config):
            if hook == "dloom_configure":
                raise error

    registration = dloom.StrategyRegistration(name, Hostile, guarantee="none")
    get_registry().strategies[name] = Strategy(name, "tests", registration)


def test_a_hook_raising_systemexit_or_keyboardinterrupt_fails_its_batch_only(model, served):
    """While good requests of two lanes decode, batches whose commit hook raises SystemExit
    or KeyboardInterrupt fail with 500 (or an error event in a stream); every good request
    gets its offline output and the worker lives on."""
    hostile("exits", SystemExit(3))
    hostile("interrupts", KeyboardInterrupt())
    good = [(PROMPTS[i % len(PROMPTS)], ("quota", "threshold")[i % 2]) for i in range(6)]
    expected = [offline(model, prompt, strategy) for prompt, strategy in good]
    before = metrics_of(served)
    client = client_of(served)
    start = threading.Barrier(len(good) + 3)

    def ask_good(case):
        start.wait()
        return client.completions.create(model=MODEL, prompt=case[0], extra_body={"strategy": case[1]}).choices[0].text

    def ask_hostile(strategy, stream=False):
        start.wait()
        try:
            if stream:
                return list(client.completions.create(model=MODEL, prompt=PROMPTS[1], stream=True, extra_body={"strategy": strategy}))
            return client.completions.create(model=MODEL, prompt=[PROMPTS[0], PROMPTS[2]], extra_body={"strategy": strategy})
        except openai.APIError as error:
            return error

    with ThreadPoolExecutor(len(good) + 3) as pool:
        texts = [pool.submit(ask_good, case) for case in good]
        exits, interrupts = pool.submit(ask_hostile, "exits"), pool.submit(ask_hostile, "interrupts")
        streamed = pool.submit(ask_hostile, "exits", True)
        assert [t.result(timeout=60) for t in texts] == expected
        exited, interrupted, stream_error = exits.result(timeout=60), interrupts.result(timeout=60), streamed.result(timeout=60)
    assert isinstance(exited, openai.InternalServerError) and "decoding failed: SystemExit: 3" in str(exited)
    assert isinstance(interrupted, openai.InternalServerError) and "decoding failed: KeyboardInterrupt" in str(interrupted)
    assert isinstance(stream_error, openai.APIError) and "decoding failed: SystemExit: 3" in str(stream_error)
    after = metrics_of(served)
    assert after['dloom_requests_total{outcome="failed"}'] - before['dloom_requests_total{outcome="failed"}'] == 3
    assert after["dloom_admitted_tokens"] == 0 and after["dloom_running_rows"] == 0
    health = httpx.get(f"{served.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert served.service.scheduler.alive


def test_a_hook_raising_systemexit_while_the_decoder_is_built_fails_that_request(model, served):
    hostile("exits-early", SystemExit("no configuration for you"), hook="dloom_configure")
    before = outcome(served, "failed")
    with pytest.raises(openai.InternalServerError, match="the server failed on this request: SystemExit: no configuration for you"):
        client_of(served).completions.create(model=MODEL, prompt=PROMPTS[0], extra_body={"strategy": "exits-early"})
    assert outcome(served, "failed") == before + 1
    assert client_of(served).completions.create(model=MODEL, prompt=PROMPTS[3]).choices[0].text == offline(model, PROMPTS[3])


def test_a_dead_worker_fails_its_rows_and_health_says_why(model):
    """Should the worker thread itself die, its rows fail at once (no wedge), /health
    answers 503 with the reason, and new requests get 503 rather than waiting for ever."""
    with BackgroundServer(ServeConfig(model, DecodeDefaults(block_length=BLOCK))) as server:
        scheduler = server.service.scheduler

        def broken_turn():
            raise SystemExit(7)

        scheduler._next_lane = broken_turn  # the worker's own code fails, outside any batch
        client = client_of(server)
        with pytest.raises(openai.InternalServerError, match="decoding failed: SystemExit: 7"):
            client.completions.create(model=MODEL, prompt=PROMPTS[0])
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "error" and health.json()["reason"] == "SystemExit: 7"
        answer = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0]})
        assert_error_object(answer, 503, "the server's decoding worker has stopped: SystemExit: 7")
        assert outcome(server, "unavailable") == 1 and metrics_of(server)["dloom_admitted_tokens"] == 0


# --- cost before work: bounded before any per-row object is built -----------------------


@pytest.mark.parametrize("body, rows", [
    (b'{"prompt": [[3], [4, 5]], "stop": ["a"]}', 2),
    (b'{"prompt": [3, 4], "n": 2}', -1),
    (b'{"prompt": ["[[[", "a\\"[["], "stop": "]["}', -1),  # brackets in strings, escaped quotes
    (b'{"prompt": "' + b"[" * 1000 + b'"}', -2),
    (b'{"prompt": [' + b"[3]," * 50 + b"[3]]}", 50),
])
def test_least_token_rows_counts_the_arrays_outside_strings(body, rows):
    assert least_token_rows(body) == rows


def test_the_cost_is_checked_from_the_parsed_body_before_any_row_is_built(model, monkeypatch):
    """Rows x n x (prompt + gen_length) against the budget (400) and the room left (429, with no line),
    for token ids exactly and for texts at one token each before they are encoded: no Job,
    no encoding, no per-row list."""
    service = Service(ServeConfig(model, DecodeDefaults(block_length=BLOCK), max_queued_tokens=1000, max_waiting_tokens=0))
    gen = service.gen_length
    monkeypatch.setattr("dloom.serve.service.Job", None)  # building one would fail
    monkeypatch.setattr(service, "_encode", None)  # so would encoding a text
    with pytest.raises(ConfigurationError, match=f"the request needs {16 * 300 * (1 + gen)} tokens .*budget of 1000"):
        service.prepare(CompletionRequest(model=MODEL, prompt=[[3]] * 300, n=16), [[3]] * 300, None)
    with pytest.raises(ConfigurationError, match=f"the request needs at least {2 * 30 * (1 + gen)} tokens"):
        service.prepare(CompletionRequest(model=MODEL, prompt=["a"] * 30, n=2), ["a"] * 30, None)
    service.scheduler._admitted_tokens = 1000 - 2 * (2 + gen) + 1  # one token short of room for the request
    with pytest.raises(QueueFullError, match=f"the server is full: .* the request needs {2 * (2 + gen)}"):
        service.prepare(CompletionRequest(model=MODEL, prompt=[5, 6], n=2), [[5, 6]], None)
    service.scheduler._admitted_tokens = 0
    with pytest.raises(ConfigurationError, match=r"the request body opens 302 JSON arrays: 300 or more prompts"):
        service.check_rows(json.dumps({"prompt": [[3]] * 300, "stop": ["x"]}).encode())
    service.check_rows(json.dumps({"prompt": [[3]] * 10, "stop": ["[" * 500]}).encode())  # fits: no refusal


def test_a_many_row_body_is_refused_over_http_before_it_is_parsed(served, monkeypatch):
    monkeypatch.setattr("dloom.serve.body.json", None)  # parsing it would fail (500)
    before = outcome(served, "invalid")
    body = json.dumps({"model": MODEL, "prompt": [[3]] * 3000, "n": 16}).encode()
    answer = httpx.post(f"{served.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error_object(answer, 400, "the request body opens 3001 JSON arrays: 2999 or more prompts of token ids")
    assert outcome(served, "invalid") == before + 1 and metrics_of(served)["dloom_admitted_tokens"] == 0


def test_a_many_text_body_is_refused_from_its_parsed_list_before_the_schema_builds_it(model, served, monkeypatch):
    """A list of text prompts, n choices each, is counted from the parsed JSON list (a text
    as one token) before the request is validated, encoded or queued; a body of another
    shape is left to its schema."""
    service = Service(ServeConfig(model, DecodeDefaults(block_length=BLOCK), max_queued_tokens=1000))
    gen = service.gen_length
    with pytest.raises(ConfigurationError, match=f"the request needs at least {16 * 300 * (1 + gen)} tokens"):
        service.check_texts({"prompt": ["copy ab"] * 300, "n": 16})
    with pytest.raises(ConfigurationError, match=f"the request needs at least {300 * (1 + gen)} tokens"):
        service.check_texts({"prompt": ["copy ab"] * 300, "n": "sixteen"})  # the schema refuses n later
    for fits in ({"prompt": ["copy ab"] * 3, "n": 2}, {"prompt": [[3]] * 300}, {"prompt": "x" * 5000}, [1, 2], None):
        service.check_texts(fits)
    monkeypatch.setattr(CompletionRequest, "model_validate", None)  # building the request would fail (500)
    before = outcome(served, "invalid")
    body = json.dumps({"model": MODEL, "prompt": ["copy ab"] * 3000, "n": 16}).encode()
    answer = httpx.post(f"{served.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error_object(answer, 400, f"the request needs at least {16 * 3000 * (1 + gen)} tokens")
    assert outcome(served, "invalid") == before + 1 and metrics_of(served)["dloom_admitted_tokens"] == 0


MANY_ROWS = {
    "token ids": ([[3]] * 300_000, "or more prompts of token ids"),
    "texts": (["a"] * 300_000, "the request needs at least"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", MANY_ROWS)
def test_a_large_many_row_request_is_refused_fast_and_small_while_a_canary_keeps_its_latency(model, kind):
    """The 1.5 MB body of 300,000 one-token rows (token ids, or one-character texts), n=16
    (4.8 million rows): refused in under 100 ms alone (the median of 5), and in under 1 s
    each when 4 clients send it 24 times at once (client and server share this process and
    its cores); the server's memory grows by under 50 MB, and a canary completion asked all
    along answers within twice its latency alone plus 1 s (it waited 21 s when every row
    was built before the budget was checked)."""
    prompts, words = MANY_ROWS[kind]
    body = json.dumps({"model": MODEL, "prompt": prompts, "n": 16}).encode()
    assert 1_400_000 < len(body) < 1_600_000
    with BackgroundServer(ServeConfig(model, DecodeDefaults(block_length=BLOCK))) as server:
        canary = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8}

        def ask_canary() -> float:
            started = time.perf_counter()
            assert httpx.post(f"{server.url}/v1/completions", json=canary, timeout=60).status_code == 200
            return time.perf_counter() - started

        alone = max(ask_canary() for _ in range(5))
        with httpx.Client(timeout=60) as client:
            once = sorted(refused_in(client, server, body, words) for _ in range(5))
        resident = [rss_bytes()]
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                resident.append(rss_bytes())
                time.sleep(0.005)

        def flood(_) -> list[float]:
            seconds = []
            with httpx.Client(timeout=60) as client:
                for _ in range(6):
                    seconds.append(refused_in(client, server, body, words))
            return seconds

        sampler = threading.Thread(target=sample)
        sampler.start()
        with ThreadPoolExecutor(4) as pool:
            floods = [pool.submit(flood, index) for index in range(4)]
            during = []
            while len(during) < 5 or not all(future.done() for future in floods):
                during.append(ask_canary())
            refusals = [s for future in floods for s in future.result()]
        sampling.set()
        sampler.join()
    growth = (max(resident) - resident[0]) / 2**20
    print(f"{kind}: refused alone in {once} s, under the flood in {sorted(refusals)} s; growth {growth:.1f} MB; "
          f"canary alone {alone:.3f} s, under the flood {sorted(during)} s")
    assert once[len(once) // 2] < 0.1, f"refusing the request alone took {once} s"
    assert len(refusals) == 24 and max(refusals) < 1, f"under the flood, refusals took {sorted(refusals)} s"
    assert growth < 50, f"the server's memory grew by {growth:.0f} MB"
    assert max(during) < 2 * alone + 1, f"the canary took {max(during):.3f} s under the flood, {alone:.3f} s alone"


def refused_in(client: httpx.Client, server: BackgroundServer, body: bytes, words: str) -> float:
    """Seconds from sending ``body`` to its 400 for a cost beyond the budget (saying ``words``)."""
    started = time.perf_counter()
    answer = client.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    seconds = time.perf_counter() - started
    assert_error_object(answer, 400, words)
    return seconds


def rss_bytes() -> int:
    """This process's resident memory (the server runs in it)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- connections: head size, header count, read and idle time ---------------------------


def test_headers_over_their_limit_are_refused_and_the_server_goes_on(model, served):
    """Headers of more bytes than the limit: 431 with the error object when the head arrives
    in one read, 400 from the protocol (which stops reading) for a head of 128 MB."""
    before = outcome(served, "too_large")
    answer = httpx.get(f"{served.url}/health", headers={"x-big": "z" * MAX_HEADER_BYTES})
    assert_error_object(answer, 431, f"bytes; allowed: at most {MAX_HEADER_BYTES} (dloom serve --max-header-bytes)")
    assert outcome(served, "too_large") == before + 1
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        with pytest.raises(OSError):  # the server answers 400 and closes before 128 MB have gone
            while sent < 128 << 20:
                connection.sendall(b"z" * (1 << 20))
                sent += 1 << 20
        assert sent < 8 << 20
    assert httpx.get(f"{served.url}/health", headers={"x-big": "z" * 1000}).status_code == 200


def test_a_connection_whose_request_arrives_too_slowly_is_closed(model):
    """With ``read_timeout`` 0.5 s: a silent connection and one that sends half a head are
    closed; a request that arrived whole is answered however long it decodes."""
    config = ServeConfig(model, DecodeDefaults(block_length=BLOCK), read_timeout=0.5)
    with BackgroundServer(config) as server:
        host, port = server.url.removeprefix("http://").split(":")
        silent, slow = socket.create_connection((host, int(port))), socket.create_connection((host, int(port)))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for connection in (silent, slow):
            connection.settimeout(5)
            started = time.perf_counter()
            assert connection.recv(1024) == b""  # closed by the server
            assert time.perf_counter() - started < 2
            connection.close()
        scheduler = server.service.scheduler
        scheduler.stop()  # the request waits in the queue, past the read timeout
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0]}, timeout=30)
            time.sleep(1.5)
            scheduler.start()
            assert waiting.result().json()["choices"][0]["text"] == offline(model, PROMPTS[0])


# --- back-pressure ----------------------------------------------------------------------


def test_a_429_says_when_to_retry(model):
    """The ``Retry-After`` of a full server: its estimate from the queue and recent rows."""
    cost = len(model.encode([PROMPTS[0]])[0]) + 32
    config = ServeConfig(model, DecodeDefaults(block_length=BLOCK), max_queued_tokens=cost, max_waiting_tokens=0)
    with BackgroundServer(config) as server:
        client = client_of(server)
        client.completions.create(model=MODEL, prompt=PROMPTS[0])  # a finished row: the estimate's basis
        scheduler = server.service.scheduler
        scheduler.stop()  # the next row stays queued
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": PROMPTS[0], "stream": True}) as waiting:
            assert waiting.status_code == 200
            deadline = time.monotonic() + 10
            while metrics_of(server)["dloom_queue_depth"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            with pytest.raises(openai.RateLimitError, match="the server is full") as raised:
                client.completions.create(model=MODEL, prompt=PROMPTS[0])
            with scheduler._ready:
                expected = scheduler.retry_after()
        retry = raised.value.response.headers["retry-after"]
        assert retry == str(expected) and int(retry) >= 1
        assert f"retry after {retry} s" in str(raised.value)
        scheduler.start()


@pytest.mark.slow
def test_a_large_request_is_not_starved_by_a_flow_of_small_ones(model):
    """The case that was starved (429 61 times in 62 s): budget 800 tokens, 24 clients
    looping on small requests, one request of 9 rows. It waits in line, is overtaken by no
    later request, and gets its offline answer; no request is refused."""
    with BackgroundServer(ServeConfig(model, DecodeDefaults(block_length=BLOCK), max_queued_tokens=800)) as server:
        stop = threading.Event()

        def small(index: int) -> int:
            answered = 0
            with httpx.Client(timeout=120) as client:
                while not stop.is_set():
                    body = {"model": MODEL, "prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": 8}
                    assert client.post(f"{server.url}/v1/completions", json=body).status_code == 200
                    answered += 1
            return answered

        with ThreadPoolExecutor(24) as pool:
            flow = [pool.submit(small, index) for index in range(24)]
            time.sleep(2)  # the flow is running: the budget is taken all the time
            started = time.perf_counter()
            large = httpx.post(f"{server.url}/v1/completions", timeout=120,
                               json={"model": MODEL, "prompt": [PROMPTS[1]] * 9})
            waited = time.perf_counter() - started
            stop.set()
            answered = sum(future.result() for future in flow)
        assert large.status_code == 200, large.text
        assert [c["text"] for c in large.json()["choices"]] == [offline(model, PROMPTS[1])] * 9
        print(f"the 9-row request waited {waited:.1f} s while {answered} small requests were answered")
        assert outcome(server, "rejected") == 0 and waited < 60


def test_retry_after_grows_with_the_queue_and_is_bounded(model):
    scheduler = Scheduler(32, max_batch_size=4, max_tokens=10**6, metrics=ServerMetrics(4))
    resolved = DecoderPool(model, DecodeDefaults(block_length=BLOCK)).default
    assert scheduler.retry_after() == 1  # no row has finished yet
    scheduler._row_seconds = 2.5
    assert scheduler.retry_after() == 3  # the batch decoding now
    scheduler.submit(resolved, [Job([5, 6], False, lambda event: None) for _ in range(10)])
    assert scheduler.retry_after() == math.ceil((1 + 10 / 4) * 2.5)
    scheduler._row_seconds = 100.0
    assert scheduler.retry_after() == 60


# --- configuration ----------------------------------------------------------------------


def test_a_body_limit_below_one_byte_is_refused(model):
    with pytest.raises(ConfigurationError, match="max_body_bytes is 0; allowed: >= 1"):
        create_app(ServeConfig(model, max_body_bytes=0))


def test_the_limits_are_configured_on_the_command_line(tmp_path, monkeypatch):
    assert ServeConfig.__dataclass_fields__["max_body_bytes"].default == MAX_BODY_BYTES == 4 * 1024 * 1024
    result = CliRunner().invoke(cli_app, ["serve", "--graph-dir", str(tmp_path / "missing")])
    assert result.exit_code == 2 and f"--graph-dir '{tmp_path / 'missing'}' is not a directory" in " ".join(result.output.split())
    result = CliRunner().invoke(cli_app, ["serve", "--max-body-bytes", "0"])
    assert result.exit_code == 2 and "--max-body-bytes" in result.output
    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.append(app))
    result = CliRunner().invoke(cli_app, ["serve", "--max-body-bytes", "1234", "--graph-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    config = served[0].state.service.config
    assert (config.max_body_bytes, config.graph_dirs) == (1234, (str(tmp_path),))
    assert (config.max_header_bytes, config.max_headers, config.read_timeout, config.keep_alive_timeout,
            config.max_connections) == (MAX_HEADER_BYTES, 100, 30.0, 5.0, 1024)
    served.clear()
    options = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: (served.append(app), options.append(kwargs)))
    result = CliRunner().invoke(cli_app, ["serve", "--max-header-bytes", "999", "--max-headers", "7", "--read-timeout", "2.5",
                                          "--keep-alive-timeout", "3", "--max-connections", "9", "--max-waiting-tokens", "0"])
    assert result.exit_code == 0, result.output
    assert options[0]["h11_max_incomplete_event_size"] == 999 and options[0]["timeout_keep_alive"] == 3.0
    assert options[0]["limit_concurrency"] == 9 and options[0]["http"].read_timeout == 2.5
    assert served[0].state.service.config.max_headers == 7
    assert served[0].state.service.scheduler.max_waiting_tokens == 0
    for flag in ("--max-header-bytes", "--max-headers", "--read-timeout", "--keep-alive-timeout", "--max-connections"):
        result = CliRunner().invoke(cli_app, ["serve", flag, "0"])
        assert result.exit_code == 2 and flag in result.output


def test_a_checkpoint_is_served_by_its_directory_name_not_its_path():
    from dloom import zoo

    path = zoo.locate(MODEL)
    service = Service(ServeConfig(dloom.load_model(str(path)), DecodeDefaults(block_length=BLOCK)))
    assert service.name == path.name
    with pytest.raises(HTTPError) as refused:
        service.check_model(CompletionRequest(model="other", prompt="x"))
    assert str(path.parent) not in str(refused.value) and repr(path.name) in str(refused.value)


def test_a_broken_offered_graph_is_refused_over_http_without_its_server_path(served, graph_dir):
    """The graph's loader names the file by its path; the answer names it by the name the
    request gave, and nothing of the directory it lies in."""
    data = json.loads((BUILTIN_DIR / GRAPH).read_text())
    data["nodes"].append({"id": len(data["nodes"]) + 1, "pairs": [[0, 99999]], "parents": [0]})
    data["budget"] = len(data["nodes"])
    (graph_dir / "broken.json").write_text(json.dumps(data))
    for strategy, key in (("spiffy", "spiffy.graph"), ("spiffy+quota", "graph")):
        answer = httpx.post(f"{served.url}/v1/completions", json={
            "model": MODEL, "prompt": PROMPTS[0], "strategy": strategy, "params": {key: "broken.json"},
        }, timeout=30)
        message = assert_error_object(answer, 400, "node 11 uses vocabulary rank 99999")["message"]
        assert "broken.json" in message and str(graph_dir) not in message and str(graph_dir.parent) not in message
        assert str(graph_dir.resolve().parent) not in message


def test_a_checkpoints_path_is_in_no_answer_over_http(tmp_path):
    """A checkpoint without a tokenizer, served from a path: the refusal of a text prompt named
    the model by its path."""
    from dloom import zoo

    directory = tmp_path / "private" / "checkpoint"
    shutil.copytree(zoo.locate(MODEL), directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).unlink()
    config = ServeConfig(dloom.load_model(str(directory)), DecodeDefaults(block_length=BLOCK))
    with BackgroundServer(config) as server:
        answer = httpx.post(f"{server.url}/v1/completions", json={"model": "checkpoint", "prompt": "copy ab"}, timeout=30)
        message = assert_error_object(answer, 400, "has no tokenizer")["message"]
        assert "'checkpoint'" in message and str(tmp_path) not in message, message
        ids = httpx.post(f"{server.url}/v1/completions", json={"model": "checkpoint", "prompt": [5, 6]}, timeout=30)
        assert ids.status_code == 200, ids.text


@pytest.mark.parametrize("name, value, words", [
    ("max_headers", 0, "max_headers is 0; allowed: >= 1"),
    ("max_header_bytes", -1, "max_header_bytes is -1; allowed: >= 1"),
    ("read_timeout", math.inf, "read_timeout is inf; allowed: seconds > 0"),
    ("keep_alive_timeout", 0.0, "keep_alive_timeout is 0.0; allowed: seconds > 0"),
])
def test_connection_limits_out_of_range_are_refused(model, name, value, words):
    with pytest.raises(ConfigurationError, match=words):
        create_app(ServeConfig(model, **{name: value}))


@pytest.mark.slow
def test_128_clients_with_disconnects_and_a_systemexit_hook_keep_every_other_lane_correct(model, served):
    """128 concurrent clients on two lanes (quota, threshold): a seeded fifth of them stream and
    hang up after their first event, eight send a strategy whose hook raises SystemExit. Every
    client that stays gets exactly its offline output, each hostile one a 500 naming SystemExit,
    and the server ends idle and healthy."""
    import random

    hostile("exits-under-load", SystemExit(7))
    chooser = random.Random(41)
    cases = []
    for index in range(128):
        kind = "hostile" if index % 16 == 5 else ("leaves" if chooser.random() < 0.2 else "stays")
        cases.append((kind, PROMPTS[index % len(PROMPTS)], ("quota", "threshold")[index % 2]))
    expected = {(p, s): offline(model, p, s) for _, p, s in cases}
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=20, timeout=120)
    start = threading.Barrier(len(cases))

    def ask(case):
        kind, prompt, strategy = case
        start.wait()
        if kind == "leaves":
            body = {"model": MODEL, "prompt": prompt, "stream": True, "strategy": strategy}
            with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as answer:
                if answer.status_code == 429:
                    return "refused"
                for _ in answer.iter_lines():
                    return "left"
            return "left"
        if kind == "hostile":
            try:
                client.completions.create(model=MODEL, prompt=prompt, extra_body={"strategy": "exits-under-load"})
            except openai.InternalServerError as error:
                return str(error)
            return "decoded"
        return client.completions.create(model=MODEL, prompt=prompt, extra_body={"strategy": strategy}).choices[0].text

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases, timeout=600))
    for (kind, prompt, strategy), answer in zip(cases, answers):
        if kind == "stays":
            assert answer == expected[(prompt, strategy)]
        elif kind == "hostile":
            assert "decoding failed: SystemExit: 7" in answer
        else:
            assert answer in ("left", "refused")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (metrics_of(served)["dloom_running_rows"] or metrics_of(served)["dloom_admitted_tokens"]):
        time.sleep(0.2)
    after = metrics_of(served)
    assert after["dloom_admitted_tokens"] == 0 and after["dloom_running_rows"] == 0
    assert httpx.get(f"{served.url}/health").status_code == 200 and served.service.scheduler.alive


@pytest.mark.slow
def test_64_clients_of_mixed_prompts_with_mask_only_ones_have_no_mismatch(model, served):
    """64 concurrent clients on two lanes (quota, threshold), with texts, token ids, prompts
    holding mask tokens among others, ``n=2`` choices, and prompts made only of the mask
    token: each of the latter is refused with 400 (it was accepted, and decoded differently
    batched than alone: 34 wrong answers under load), and every other answer, every choice,
    equals its prompt decoded alone offline."""
    import random

    chooser = random.Random(55)
    mixed: list[str | list[int]] = [*PROMPTS, [5, 17, 18, 27, 39, 3, 4], [5, 1, 1], [1, 1, 5, 9], [1, 7]]
    cases = []
    for index in range(64):
        prompt = [1] * chooser.randint(1, 4) if index % 8 == 3 else chooser.choice(mixed)
        cases.append((prompt, ("quota", "threshold")[index % 2], 1 + index % 3 // 2))
    expected = {(str(p), s): offline(model, p, s) for p, s, _ in cases if set(p) != {1}}
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=20, timeout=120)
    start = threading.Barrier(len(cases))
    before = outcome(served, "invalid")

    def ask(case) -> list[str] | str:
        prompt, strategy, n = case
        start.wait()
        try:
            answer = client.completions.create(model=MODEL, prompt=prompt, n=n, extra_body={"strategy": strategy})
        except openai.BadRequestError as error:
            return str(error)
        return [choice.text for choice in answer.choices]

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases, timeout=600))
    mismatches = refused = 0
    for (prompt, strategy, n), answer in zip(cases, answers):
        if set(prompt) == {1}:
            assert isinstance(answer, str) and "prompt 0 is made only of the mask token (id 1)" in answer, answer
            refused += 1
        else:
            assert isinstance(answer, list) and len(answer) == n, answer
            mismatches += sum(text != expected[(str(prompt), strategy)] for text in answer)
    assert refused == 8 and mismatches == 0
    assert outcome(served, "invalid") == before + 8
    assert httpx.get(f"{served.url}/health").status_code == 200 and served.service.scheduler.alive
