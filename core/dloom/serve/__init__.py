"""An OpenAI-compatible HTTP server for dLLMs decoded by dloom (``dloom serve``).

* :mod:`dloom.serve.app`: the FastAPI app (:func:`create_app`, :class:`ServeConfig`);
* :mod:`dloom.serve.schemas`: request bodies;
* :mod:`dloom.serve.decoders`: request settings resolved into validated decoders;
* :mod:`dloom.serve.scheduler`: the queue, lanes and the batching worker;
* :mod:`dloom.serve.text`: ``max_tokens``, stop sequences and streamed text;
* :mod:`dloom.serve.responses`: choices, usage and errors;
* :mod:`dloom.serve.errors`: OpenAI error objects for FastAPI's own refusals and failures;
* :mod:`dloom.serve.limits`: the body, prompt-text and stop-sequence limits;
* :mod:`dloom.serve.files`: the server files a request may name in path parameters;
* :mod:`dloom.serve.metrics`: the Prometheus counters;
* :mod:`dloom.serve.command`: the ``dloom serve`` command.

FastAPI and uvicorn are an optional extra (``pip install -e ".[serve]"`` in a clone of dloom); importing this
package (or :mod:`dloom.serve.command`) imports neither them nor torch; :mod:`dloom.serve.app`
needs them.
"""
