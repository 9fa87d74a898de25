"""``dloom serve``: run the OpenAI-compatible server with uvicorn.

Importing this module needs neither FastAPI nor uvicorn (the command line loads it for its
help); running the command does (``pip install -e ".[serve]"`` in a clone of dloom). The
command raises :class:`dloom.errors.DloomError` for bad settings; the command line that mounts
it prints them.
"""

from __future__ import annotations

import typer

from dloom.hooks.registry import DEFAULT_STRATEGY


def serve(
    model: str | None = typer.Option(None, "--model", "-m", help="Toy-zoo name or local checkpoint directory of the dLLM (default toy-dllm)."),
    strategy: str = typer.Option(DEFAULT_STRATEGY, "--strategy", "-s", help="Default strategy (a request may name another that runs on the same models)."),
    param: list[str] = typer.Option([], "--param", "-p", help="Default strategy parameter NAME=VALUE (repeatable)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    gen_length: int | None = typer.Option(None, help="Generated positions per prompt (default: the model's, else 128); the most max_tokens may ask."),
    block_length: int | None = typer.Option(None, help="Positions per block: the granularity of streaming."),
    steps: int | None = typer.Option(None, help="Step budget for quota rules (default gen_length)."),
    remasking: str = typer.Option("low_confidence", help="low_confidence, random, margin or entropy."),
    cache: str = typer.Option("none", "--cache", help="Default KV cache policy: none, prefix, dual or a plugin's (dloom_register_cache_policies)."),
    cache_refresh: int | None = typer.Option(None, "--cache-refresh", help="With --cache: a full forward every N forwards of a block."),
    max_batch_size: int = typer.Option(16, min=1, help="Rows decoded together, at most."),
    max_queued_tokens: int = typer.Option(65536, min=1, help="Token budget of admitted rows (prompt + gen_length each); beyond it requests wait in line (--max-waiting-tokens)."),
    max_waiting_tokens: int = typer.Option(65536, min=0, help="Token budget of requests held in line, first come first served, until --max-queued-tokens has room; beyond it requests get 429 (0: at once)."),
    plain_chat: bool = typer.Option(False, "--plain-chat", help="Without a chat template, join chat messages with spaces instead of refusing."),
    max_body_bytes: int = typer.Option(4 * 1024 * 1024, min=1, help="Longest request body taken, in bytes; a longer one gets 413."),
    max_header_bytes: int = typer.Option(32 * 1024, min=1, help="Longest request head (request line and headers) taken, in bytes; a longer one gets 400."),
    max_headers: int = typer.Option(100, min=1, help="Most headers a request may have; more get 431."),
    read_timeout: float = typer.Option(30.0, min=0.001, max=86400.0, help="Seconds a request's head and body may take to arrive; a slower connection is closed."),
    keep_alive_timeout: float = typer.Option(5.0, min=0.001, max=86400.0, help="Seconds an idle connection stays open after a response."),
    max_connections: int = typer.Option(1024, min=1, help="Open connections at most; beyond them requests get 503."),
    graph_dir: list[str] = typer.Option([], "--graph-dir", help="Directory whose files requests may name in path parameters such as a draft graph (repeatable); requests never name paths."),
    device: str = typer.Option("cpu", help="torch device, e.g. cpu or cuda."),
    dtype: str = typer.Option("float32", help="float32, float64, bfloat16 or float16."),
    target: str | None = typer.Option(None, "--target", help="AR target of an AR-target default strategy (default toy-ar); the server returns its outputs."),
    drafter: str | None = typer.Option(None, "--drafter", help="dLLM drafter of an AR-target default strategy (default toy-dllm)."),
) -> None:
    """Serve a dLLM (or an AR target with its dLLM drafter) over an OpenAI-compatible HTTP API
    (/v1/completions, /v1/chat/completions). The models are those the default strategy runs
    on, chosen and loaded by :mod:`dloom.factory` as ``dloom generate`` does."""
    from dloom.errors import ConfigurationError
    from dloom.factory import parse_params, select_models

    try:
        import uvicorn

        from dloom.serve.app import ServeConfig, create_app
        from dloom.serve.connections import uvicorn_options
        from dloom.serve.decoders import DecodeDefaults
    except ImportError as error:
        raise ConfigurationError(f"dloom serve needs FastAPI and uvicorn ({error}); pip install -e \".[serve]\" in a clone of dloom") from None
    defaults = DecodeDefaults(
        strategy=strategy, params=parse_params(param), cache=cache, cache_refresh=cache_refresh,
        gen_length=gen_length, block_length=block_length, steps=steps, remasking=remasking,
    )
    models = select_models(model, strategy, target=target, drafter=drafter, device=device, dtype=dtype).load()
    config = ServeConfig(
        models.model, defaults, max_batch_size=max_batch_size,
        max_queued_tokens=max_queued_tokens, max_waiting_tokens=max_waiting_tokens, plain_chat=plain_chat,
        max_body_bytes=max_body_bytes, graph_dirs=tuple(graph_dir), drafter=models.drafter,
        max_header_bytes=max_header_bytes, max_headers=max_headers, read_timeout=read_timeout,
        keep_alive_timeout=keep_alive_timeout, max_connections=max_connections,
    )
    app = create_app(config)
    uvicorn.run(app, host=host, port=port, log_level="info", **uvicorn_options(config))
