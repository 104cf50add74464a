"""What tests, benchmarks and the contract suite share, and the product never imports.

``testing.vllm_scheduler``: vLLM's real Scheduler in-process with a synthetic model (the one
scheduler factory, request factory and step, and ``ProbeConnector``), for the scenarios, the
connector's scheduler tests and Replay A. ``testing.scenarios``: each transform's scheduler
scenario, and the protocol that runs them against a vLLM tree in another interpreter
(``python -m testing.scenarios``; ``record`` is what the image builder bakes in as the contract
suite's expected results). ``testing.tinymodel``: random-weight models and LoRA adapters made
offline. The image bakes this folder in beside ``contracts/`` (``/opt/sparkcache/testing``), as
its contract suite uses it; ``tests/test_import_graph.py`` keeps ``sparkcache/``, ``transforms/``,
``images/builder/`` and ``build.py`` from importing it.
"""
