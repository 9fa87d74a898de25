"""The model side: loading checkpoints and calling the model.

* :mod:`dloom.model.adapter`: :class:`~dloom.model.adapter.ModelAdapter` (what the decoder
  needs to know about a Hugging Face model) and :func:`~dloom.model.adapter.load_model`.
  :meth:`ModelAdapter.raw_logits <dloom.model.adapter.ModelAdapter.raw_logits>` is the one
  place dloom calls a model (every decoder, cache, verification layout and the AR target go
  through it); the logit shift, the cache argument's name and ``logits_to_keep`` support
  are read off the model once, there.
* :mod:`dloom.model.runner`: the model runner, block forwards over ``transformers`` KV caches
  (Fast-dLLM's prefix and dual cache).
* :mod:`dloom.model.cache_policy`: the cache policies the runner asks (``none``, ``prefix``,
  ``dual``, registered through a hook as a plugin's are).
* :mod:`dloom.model.profiles`: model families, the conventions a checkpoint's config implies;
  :mod:`dloom.model.families`: a family (profile and native layout) as a registration of the
  ``dloom_register_families`` hook, and how a config's family is recognised;
  :mod:`dloom.model.builtin_families`: the core's families, registered through that hook.
* :mod:`dloom.model.checkpoints`, :mod:`dloom.model.files`, :mod:`dloom.model.json_files`,
  :mod:`dloom.model.config_limits`, :mod:`dloom.model.tensor_check`: reading and checking a
  checkpoint's files, config and tensors before loading it.
* :mod:`dloom.model.bailing`: BailingMoeV2, the network of LLaDA2.x, which ``transformers``
  lacks, as a ``transformers`` model written here.
* :mod:`dloom.model.attention`: the attention masks the models are called with.
"""
