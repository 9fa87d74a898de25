"""The Ray Serve deployment (dloom.ray.serve) on a real local Ray runtime: two replicas of the
dloom server behind Ray Serve's HTTP proxy on 127.0.0.1, answering the official ``openai``
client with the outputs of decoding each prompt alone offline.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need the optional extra ray (pip install -e '.[ray]')")
serve = pytest.importorskip("ray.serve", reason="the Ray Serve tests need the optional extra ray (pip install -e '.[ray]')")
openai = pytest.importorskip("openai")

import dloom  # noqa: E402
from dloom.errors import ConfigurationError, UnknownStrategyError  # noqa: E402
from dloom.ray.serve import server_application  # noqa: E402

BLOCK = 8
PROMPTS = ["add 40 20", "copy hello world abc", "rev iprmgsqepy4rxu", "sort 2979625", "copy eezej spmk", "add 12 30"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def url():
    """Two replicas of the server for toy-dllm, served by Ray Serve on a free local port."""
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = server_application(
        "toy-dllm", strategy="threshold", params={"tau": 0.9}, block_length=BLOCK,
        num_replicas=2, ray_actor_options={"num_cpus": 0.5},
    )
    serve.run(app, name="dloom", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def offline_text(prompt: str) -> str:
    model = dloom.load_model("toy-dllm")
    decoder = dloom.DiffusionDecoder(model, "threshold", tau=0.9, block_length=BLOCK)
    return decoder.generate([prompt]).texts[0]


def test_two_replicas_serve_the_offline_decodes(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["toy-dllm"]

    def complete(prompt: str) -> str:
        return client.completions.create(model="toy-dllm", prompt=prompt, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(complete, PROMPTS))
    assert texts == [offline_text(p) for p in PROMPTS]
    status = serve.status().applications["dloom"].deployments["dloom"]
    assert status.replica_states.get("RUNNING") == 2


def test_streams_through_the_proxy(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(model="toy-dllm", prompt=PROMPTS[1], temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == offline_text(PROMPTS[1])


def test_bad_settings_are_refused_before_any_replica_starts():
    with pytest.raises(UnknownStrategyError, match="no-such-rule"):
        server_application(strategy="no-such-rule")
    with pytest.raises(ConfigurationError, match="num_replicas is 0"):
        server_application(num_replicas=0)
    with pytest.raises(ConfigurationError, match="--model toy-dllm does not apply to --strategy failfast"):
        server_application("toy-dllm", strategy="failfast")


def test_a_hook_swap_and_an_ar_target_strategy_are_taken_on_the_driver():
    """The driver reads the default strategy with the one spec parser (``NAME@HOOK`` included)
    and takes the models an AR-target strategy runs on; no replica starts."""
    for strategy in ("spiffy+quota+threshold@select_commit", "failfast"):
        assert server_application(strategy=strategy) is not None
