"""sparkcache's KV connector for vLLM 0.32.0 (``KVConnectorBase_V1`` + ``SupportsHMA``).

Load it with::

    kv_transfer_config={"kv_connector": "SparkcacheConnector",
                        "kv_connector_module_path": "sparkcache.connector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"root": "/var/cache/sparkcache", ...}}

vLLM is imported lazily: importing this package does not import vLLM; touching
``SparkcacheConnector`` does. Modules: ``keys`` (identity and block keys), ``attribution``
(per-request records), ``capture_slots`` (bounded asynchronous publication),
``scheduler_side`` / ``worker_side`` (the two halves), ``kv_copy`` (every tensor
operation of capture and restore), ``stats`` (vLLM stats and Prometheus hooks),
``connector`` (the class vLLM loads).
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("SparkcacheConnector", "SparkcacheConnectorMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(name)
