"""What tests, benchmarks and the contract suite share, and the product never imports.

``testing.tinymodel``: random-weight models and LoRA adapters made offline. The image bakes this
folder in beside ``contracts/`` (``/opt/sparkcache/testing``), as its contract suite uses it;
``tests/test_import_graph.py`` keeps ``sparkcache/``, ``transforms/``, ``images/builder/`` and
``build.py`` from importing it.
"""
