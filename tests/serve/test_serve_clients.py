"""The OpenAI fields that clients (lm-evaluation-harness, guidellm, the ``openai`` client)
send, against a real uvicorn server on 127.0.0.1 with the official ``openai`` client, on
the shipped toy-dllm: one row per field, honoured (the answer checked against an offline
decode) or refused with the exact status and words (``docs/serving.md``, field table).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
import torch
from typer.testing import CliRunner

import dloom
from dloom.cli.commands import app as cli_app
from dloom.decode.session import DecodeSession
from dloom.evaluation import select_examples
from dloom.serve.app import ServeConfig
from dloom.serve.background import BackgroundServer
from dloom.serve.decoders import DecodeDefaults

MODEL = "toy-dllm"
BLOCK = 8
PROMPT = "sort 29796252137"
CHECKPOINT = Path(dloom.__file__).parent / "zoo" / "models" / MODEL  # its tokenizer, for guidellm


@pytest.fixture(scope="module")
def model():
    return dloom.load_model(MODEL)


@pytest.fixture(scope="module")
def served(model):
    server = BackgroundServer(ServeConfig(model, DecodeDefaults(block_length=BLOCK), plain_chat=True))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)


def offline(model, prompt, **settings):
    """The text and counted tokens of ``prompt`` decoded alone by a fresh decoder."""
    result = dloom.DiffusionDecoder(model, "quota", block_length=BLOCK, **settings).generate([prompt])
    tokens = result.token_lists[0]
    return model.decode([t for t in tokens if t not in model.eos_token_ids]), tokens


# --- accepted and honoured ----------------------------------------------------------------

ACCEPTED = [
    {"user": "someone"},
    {"top_p": 0.5},  # greedy: the most likely token is always in the nucleus
    {"top_p": 1.0, "temperature": 0.0},
    {"presence_penalty": 0, "frequency_penalty": 0.0},
    {"extra_body": {"ignore_eos": False}},
    {"stream_options": None},
    {"logprobs": None, "echo": False, "n": 1},
]


@pytest.mark.parametrize("fields", ACCEPTED, ids=[str(f) for f in ACCEPTED])
def test_a_field_with_a_value_dloom_honours_gives_the_offline_decode(model, client, fields):
    response = client.completions.create(model=MODEL, prompt=PROMPT, **fields)
    assert response.choices[0].text == offline(model, PROMPT)[0]


def test_n_greedy_gives_n_identical_choices_each_counted(model, client):
    response = client.completions.create(model=MODEL, prompt=[PROMPT, "add 40 20"], n=3)
    texts = [offline(model, PROMPT)[0]] * 3 + [offline(model, "add 40 20")[0]] * 3
    assert [c.index for c in response.choices] == list(range(6))
    assert [c.text for c in response.choices] == texts
    prompt_tokens = sum(len(ids) for ids in model.encode([PROMPT, "add 40 20"]))
    assert response.usage.prompt_tokens == prompt_tokens  # each prompt once, whatever n


def test_n_sampled_choices_draw_from_distinct_streams_of_the_seed(model, client):
    settings = {"temperature": 3.0, "seed": 7}
    response = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **settings)
    # choice i is row i of the request: generate([prompt] * 3) with the same seed
    result = dloom.DiffusionDecoder(model, "quota", block_length=BLOCK, **settings).generate([PROMPT] * 3)
    expected = [model.decode([t for t in row if t not in model.eos_token_ids]) for row in result.token_lists]
    assert [c.text for c in response.choices] == expected
    assert len(set(expected)) > 1  # distinct streams: the choices differ


def past_eos(model, prompt):
    """The generated region of ``prompt`` decoded alone with ``ignore_eos``, and its NFE."""
    decoder = dloom.DiffusionDecoder(model, "quota", block_length=BLOCK)
    session = DecodeSession(decoder, ignore_eos=True)
    session.admit(model.encode([prompt]))
    done = None
    while session.size:
        done = session.step() or done
    assert done is not None
    return done.generated[0].tolist(), int(done.nfe[0])


def test_ignore_eos_decodes_the_whole_region_past_eos(model, client):
    tokens, nfe = past_eos(model, PROMPT)
    text, plain = offline(model, PROMPT)
    assert tokens[: len(plain)] == plain and len(tokens) == 32 > len(plain)  # the same up to its EOS, then more
    eos = set(model.eos_token_ids)
    response = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.finish_reason == "length" and response.usage.completion_tokens == 32
    assert choice.text == model.decode([t for t in tokens if t not in eos]) and choice.text.startswith(text)
    assert response.usage.nfe == nfe > offline_nfe(model, PROMPT)
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, extra_body={"ignore_eos": True})
    assert cut.usage.completion_tokens == 20 and cut.choices[0].finish_reason == "length"


@pytest.mark.parametrize("strategy, settings", [("quota", {}), ("threshold", {"cache": "dual"}), ("quota", {"temperature": 1.5, "seed": 2})])
def test_ignore_eos_keeps_every_row_the_same_up_to_its_eos(model, strategy, settings):
    prompts = ["add 40 20", "copy eezej spmk", PROMPT, "rev iprmgsqepy4rxu"]
    decoder = dloom.DiffusionDecoder(model, strategy, block_length=BLOCK, **settings)
    plain = decoder.generate(prompts)
    session = DecodeSession(decoder, ignore_eos=True)
    session.admit(model.encode(prompts))
    rows = {}
    while session.size:
        done = session.step()
        if done is not None:
            rows.update(zip(done.rows.tolist(), done.generated.tolist()))
    for index, tokens in enumerate(plain.token_lists):
        assert rows[index][: len(tokens)] == tokens and model.mask_token_id not in rows[index]


def offline_nfe(model, prompt):
    return int(dloom.DiffusionDecoder(model, "quota", block_length=BLOCK).generate([prompt]).nfe[0])


def test_echo_puts_the_prompt_before_the_completion(model, client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, echo=True)
    assert response.choices[0].text == PROMPT + offline(model, PROMPT)[0]
    ids = model.encode([PROMPT])[0]
    response = client.completions.create(model=MODEL, prompt=ids, echo=True)
    assert response.choices[0].text == model.decode(ids) + offline(model, PROMPT)[0]


def test_echo_in_a_stream_comes_first(model, client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, stream=True)
    texts = [c.choices[0].text for c in stream if c.choices]
    assert texts[0] == PROMPT and "".join(texts) == PROMPT + offline(model, PROMPT)[0]


def test_completion_logprobs_are_the_commit_time_log_probabilities(model, client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2)
    text, tokens = offline(model, PROMPT)
    choice = response.choices[0]
    assert choice.text == text  # recording changes nothing
    logprobs = choice.logprobs
    assert logprobs.tokens == [model.decode([t]) for t in tokens]
    assert len(logprobs.token_logprobs) == len(tokens) == response.usage.completion_tokens
    assert all(v <= 0 for v in logprobs.token_logprobs)
    # greedy: each token is its distribution's most likely one, so it heads its alternatives
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(value) and top[token] == pytest.approx(value)
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[1:] == list(torch.tensor([len(t) for t in logprobs.tokens]).cumsum(0)[:-1].tolist())


def test_logprobs_zero_gives_token_logprobs_and_no_alternatives(client):
    logprobs = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0).choices[0].logprobs
    assert logprobs.top_logprobs is None and len(logprobs.token_logprobs) > 0


def test_chat_logprobs_have_the_chat_layout(model, client):
    messages = [{"role": "user", "content": PROMPT}]
    response = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=1)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.bytes == list(item.token.encode())


def test_include_usage_and_continuous_usage_stats(model, client):
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, stream=True,
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    chunks = list(stream)
    tokens = len(offline(model, PROMPT)[1])
    prompt_tokens = len(model.encode([PROMPT])[0])
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1 and all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in text_chunks]
    assert counts == sorted(counts) and counts[-1] == tokens
    assert all(c.usage.prompt_tokens == prompt_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == prompt_tokens + tokens


def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True},
    ))
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


# --- refused with 400 naming the field -----------------------------------------------------

REFUSED = [
    ({"presence_penalty": 0.5}, 400, "presence_penalty is 0.5; allowed: 0"),
    ({"frequency_penalty": -1}, 400, "frequency_penalty is -1.0; allowed: 0"),
    ({"top_p": 0.9, "temperature": 0.7}, 400, "top_p is 0.9 with temperature 0.7; allowed: top_p 1 when sampling"),
    ({"top_p": 0}, 422, "top_p: Input should be greater than 0"),
    ({"logprobs": 21}, 422, "logprobs: Input should be less than or equal to 20"),
    ({"logprobs": 1, "echo": True}, 400, "echo with logprobs is not supported"),
    ({"logprobs": 1, "stream": True}, 400, "logprobs with stream is not supported"),
    ({"logprobs": 1, "extra_body": {"strategy": "spiffy+quota"}}, 400, "logprobs with a speculative strategy is not supported"),
    ({"n": 0}, 422, "n: Input should be greater than or equal to 1"),
    ({"extra_body": {"stream_options": {"include_usage": True, "other": 1}}, "stream": True}, 422, "stream_options.other: Extra inputs"),
    ({"extra_body": {"stream_options": {"include_usage": True}}}, 400, "stream_options is given without stream; allowed: stream_options only with stream true"),
]


@pytest.mark.parametrize("fields, status, words", REFUSED, ids=[w for _, _, w in REFUSED])
def test_a_value_dloom_cannot_honour_is_refused_naming_the_field(served, client, fields, status, words):
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(model=MODEL, prompt=PROMPT, **fields)
    assert raised.value.status_code == status
    assert words in str(raised.value)
    assert httpx.get(f"{served.url}/health").json()["admitted_tokens"] == 0  # nothing was queued


def test_chat_top_logprobs_without_logprobs_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs is 2 without logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], top_logprobs=2)


# --- real clients: lm-evaluation-harness and guidellm (slow; pip install -e ".[clients]") ----

TASKS = "add,sort,reverse,copy,lookup,code"  # families whose checker is exact match of the answer
LOSSY = {"strategy": "threshold", "params": {"tau": 0.3}}  # below 100 % on these, so equality means something


def client_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[clients]')")
    return path


def offline_env(tmp_path) -> dict[str, str]:
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
            "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def lossy_served(model):
    defaults = DecodeDefaults(strategy=LOSSY["strategy"], params=LOSSY["params"])
    server = BackgroundServer(ServeConfig(model, defaults, plain_chat=True))
    yield server
    server.stop()


def dloom_eval(examples: int) -> dict:
    """``dloom eval --json`` of the lossy setting: its records and its summary."""
    result = CliRunner().invoke(cli_app, [
        "eval", "--tasks", TASKS, "-n", str(examples), "-s", LOSSY["strategy"], "-p", "tau=0.3", "--json",
    ])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    return {"records": lines[:-1], "summary": lines[-1]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local-completions", "local-chat-completions"])
def test_lm_eval_accuracy_equals_dloom_eval(lossy_served, tmp_path, kind):
    lm_eval = client_tool("lm_eval")
    examples = select_examples(TASKS, 24)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in examples))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "dloom_toy.yaml").write_text(LM_EVAL_TASK.format(data=data))
    endpoint = "chat/completions" if kind == "local-chat-completions" else "completions"
    args = [
        lm_eval, "--model", kind, "--tasks", "dloom_toy", "--include_path", str(tmp_path / "tasks"),
        "--model_args", f"model={MODEL},base_url={lossy_served.url}/v1/{endpoint},tokenized_requests=False,"
        "tokenizer_backend=none,num_concurrent=4,max_retries=1",
        "--output_path", str(tmp_path / "out"), "--log_samples",
    ]
    if kind == "local-chat-completions":
        args.append("--apply_chat_template")
    run = subprocess.run(args, env=offline_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_dloom_toy_*.jsonl")).open()]
    reference = dloom_eval(24)
    answers = {e.prompt: e.answer for e in examples}
    # the checker of these families is exact match, so lm-eval's metric grades as dloom eval does
    assert all(r["correct"] == (r["text"] == answers[r["prompt"]]) for r in reference["records"])
    assert 0 < reference["summary"]["accuracy"] < 1
    assert results["results"]["dloom_toy"]["exact_match,none"] == pytest.approx(reference["summary"]["accuracy"])
    texts = {r["prompt"]: r["text"] for r in reference["records"]}
    assert {s["doc"]["prompt"]: s["resps"][0][0] for s in samples} == texts  # and each answer is the same


LM_EVAL_TASK = """task: dloom_toy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: 32
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_benchmark_finishes_without_errors(served, tmp_path, endpoint):
    guidellm = client_tool("guidellm")
    prompts = [e.prompt for e in select_examples(TASKS, 12)]
    data = tmp_path / "prompts.jsonl"
    # a fixed output length makes guidellm send ignore_eos with max_tokens 16
    data.write_text("".join(json.dumps({"prompt": p, "output_tokens_count": 16}) + "\n" for p in prompts))
    output = tmp_path / "benchmark.json"
    run = subprocess.run([
        guidellm, "run",
        "--backend", f"kind=openai_http,target={served.url},model={MODEL},request_format={endpoint}",
        "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=12",
        "--data", f"kind=json_file,path={data}", "--tokenizer", f"kind=hf_auto,model={CHECKPOINT}",
        "--output", f"kind=json,path={output}", "--disable-progress", "--disable-console-interactive",
    ], env=offline_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    requests = json.loads(output.read_text())["benchmarks"][0]["requests"]
    assert [len(requests[k]) for k in ("successful", "errored", "incomplete")] == [12, 0, 0], requests["errored"][:1]
    assert json.loads(requests["successful"][0]["request_args"])["body"]["ignore_eos"] is True
    assert [r["output_metrics"]["text_tokens"] for r in requests["successful"]] == [16] * 12
    model = dloom.load_model(MODEL)
    eos = set(model.eos_token_ids)
    expected = sorted(model.decode([t for t in past_eos(model, p)[0][:16] if t not in eos]) for p in prompts)
    assert sorted(r["output"] for r in requests["successful"]) == expected  # the streamed text whole


def test_chat_text_parts_are_joined_and_other_parts_refused(model, client):
    parts = [{"type": "text", "text": "sort 2979"}, {"type": "text", "text": "6252137"}]
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}])
    assert response.choices[0].message.content == offline(model, PROMPT)[0]
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.UnprocessableEntityError, match="content part of type 'image_url'; allowed: text parts"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": image}])
