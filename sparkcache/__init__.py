"""sparkcache: durable prefix-state / KV-cache store for vLLM.

The store (``sparkcache.store``), settings table (``sparkcache.settings``), metrics
(``sparkcache.metrics``) and CLI (``python -m sparkcache``) depend only on the standard
library and ``prometheus_client``; nothing here imports vLLM or torch.
"""

__version__ = "0.1.0"
