"""A Ray Serve deployment of ``dloom serve``'s OpenAI-compatible app.

:func:`server_application` returns a bound Ray Serve application: each replica loads the
models the default strategy runs on itself (:func:`dloom.factory.select_models`, as ``dloom
serve`` does; one replica per GPU with ``ray_actor_options={"num_gpus": 1}``) and runs the
same FastAPI app as ``dloom serve`` (:func:`dloom.serve.app.create_app`), scheduler and
continuous batching included; Ray Serve's proxy spreads requests over the replicas. Run it
with ``serve.run(app, route_prefix="/")`` and point any OpenAI client at ``/v1``.

Replicas are independent servers: a request is decoded by one replica, with the batch
invariance that replica's scheduler guarantees, so its output equals the offline decode
whichever replica serves it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dloom.errors import ConfigurationError
from dloom.factory import select_models
from dloom.hooks.registry import DEFAULT_STRATEGY


def server_application(
    model: str | None = None,
    *,
    strategy: str = DEFAULT_STRATEGY,
    params: Mapping[str, Any] | None = None,
    cache: str = "none",
    gen_length: int | None = None,
    block_length: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    max_batch_size: int = 16,
    max_queued_tokens: int = 65536,
    plain_chat: bool = False,
    num_replicas: int = 1,
    autoscaling_config: Mapping[str, Any] | None = None,
    ray_actor_options: Mapping[str, Any] | None = None,
    name: str = "dloom",
    target: str | None = None,
    drafter: str | None = None,
):
    """The dloom server as a Ray Serve application (``serve.run`` it).

    :param model: a zoo name or a checkpoint directory every replica can read (the dLLM;
        default ``toy-dllm``).
    :param strategy: the default strategy (a request may name another).
    :param params: default strategy parameters.
    :param cache: the default KV cache mode.
    :param gen_length: generated positions per prompt (the most ``max_tokens`` may ask).
    :param block_length: positions per block, the granularity of streaming.
    :param device: each replica's torch device (``"cuda"``: the GPU Ray gives it).
    :param dtype: the model's dtype name.
    :param max_batch_size: rows one replica decodes together, at most.
    :param max_queued_tokens: one replica's token budget before it answers 429.
    :param plain_chat: join chat messages with spaces for a model without a chat template.
    :param num_replicas: fixed replica count (ignored with ``autoscaling_config``).
    :param autoscaling_config: Ray Serve autoscaling, e.g. ``{"min_replicas": 1,
        "max_replicas": 4, "target_ongoing_requests": 16}``.
    :param ray_actor_options: each replica's resources (default ``{"num_cpus": 1}``; add
        ``"num_gpus": 1`` on a GPU cluster).
    :param name: the deployment's name.
    :param target: the AR target of an ``"ar-target"`` default strategy (default ``toy-ar``);
        its outputs are served.
    :param drafter: the dLLM drafter of an ``"ar-target"`` default strategy (default ``toy-dllm``).
    :raises ConfigurationError: for a replica count below 1, or a model option the default
        strategy does not take (:func:`dloom.factory.select_models`).
    :raises UnknownStrategyError: for a default strategy no plugin registers.
    """
    from dloom.serve.decoders import DecodeDefaults
    from ray import serve

    if autoscaling_config is None and num_replicas < 1:
        raise ConfigurationError(f"num_replicas is {num_replicas}; allowed: >= 1")
    models = select_models(model, strategy, target=target, drafter=drafter, device=device, dtype=dtype)
    defaults = DecodeDefaults(
        strategy=strategy, params=dict(params or {}), cache=cache, gen_length=gen_length,
        block_length=block_length,
    )

    def build_app():
        """Runs in each replica: load the models there and build the server app."""
        from dloom.serve.app import ServeConfig, create_app

        loaded = models.load()
        return create_app(ServeConfig(
            loaded.model, defaults, max_batch_size=max_batch_size,
            max_queued_tokens=max_queued_tokens, plain_chat=plain_chat, drafter=loaded.drafter,
        ))

    options: dict[str, Any] = {
        "name": name,
        "ray_actor_options": dict(ray_actor_options or {"num_cpus": 1}),
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = dict(autoscaling_config)
    else:
        options["num_replicas"] = num_replicas
    return serve.deployment(serve.ingress(build_app)(), **options).bind()  # type: ignore[attr-defined]  # ray types deployment() as a decorator only
