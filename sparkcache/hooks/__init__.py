"""What the transformed vLLM scheduler calls: the logic of each scheduler transform, as code.

The transforms (``transforms/*.py``) insert a few call sites into vLLM 0.32.0's scheduler and
KV-cache managers. Each transform's edit in ``Scheduler.__init__`` looks for its option key in
``kv_connector_extra_config`` and, only when the key is present, imports its module here and
attaches the object that holds its state; every other call site is
``if self.sparkcache_<name> is not None: ...``. With the keys absent the transformed vLLM never
imports sparkcache and behaves as upstream.

One module per transform (its docstring says what vLLM does without it). vLLM's types are
imported for annotations only, so the modules type-check against the pinned vLLM and import
without it.
"""
