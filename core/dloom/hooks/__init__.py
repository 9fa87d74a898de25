"""The hooks: what a strategy can implement and how the core calls it.

* :mod:`dloom.hooks.specs`: the hook specifications and the ``hookimpl`` marker.
* :mod:`dloom.hooks.calls`: typed calls of each hook, with the answer's type checked.
* :mod:`dloom.hooks.registry`: the strategies registered by plugins (entry points).
* :mod:`dloom.hooks.composition`: one plugin manager per strategy, composed from plugins.
* :mod:`dloom.hooks.timing`: the hook timer, dloom's own wrapper plugin.
* :mod:`dloom.hooks.cache_policies`: the KV cache policies registered by the core and plugins.
"""
