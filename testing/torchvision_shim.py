"""``import torchvision`` beside torch 2.13.0+cpu, for a test process that needs vLLM modules which
import it (vLLM's multimodal models, and ``vllm.models.glm5next`` through ``glm4_1v``).

PyPI's torchvision 0.28.0 (the release built against torch 2.13.0) is a CUDA build: its C
extensions (``_C.so``, ``image.so``) link ``libtorch_cuda.so`` and fail to load beside the CPU
torch. torchvision then runs on without its operators (``torchvision.extension._has_ops()`` is
False, and its Python operator wrappers raise), except that ``torchvision._meta_registrations``
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` unconditionally, which
fails ("operator torchvision::nms does not exist"). :func:`install` defines those two operators'
schemas, exactly as torchvision's C++ sources declare them, with no kernel, then imports
torchvision from the unpacked wheel: calling either operator still fails, as it would without
the shim. vLLM's CPU path calls no torchvision operator.

The wheel is not installed into the venv (``make`` keeps torchvision out of it: a CUDA build in
site-packages breaks ``import vllm``). ``make test-wheels`` (a prerequisite of ``make test``)
downloads it, pinned by hash (``requirements/test-wheels.txt``), into ``.cache/wheels``; this
module unpacks it once into ``.cache/torchvision-<version>`` and puts that first on ``sys.path``
of the calling process only. The product (``sparkcache/``) never imports this module
(``tests/test_import_graph.py``).
"""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from pathlib import Path

VERSION = "0.28.0"  # the torchvision release whose wheel requires torch==2.13.0
WHEEL = f"torchvision-{VERSION}-cp311-cp311-manylinux_2_28_x86_64.whl"
REPO = Path(__file__).resolve().parents[1]

# torchvision/csrc/ops/nms.cpp and ops/quantized/cpu/qnms_kernel.cpp's TORCH_LIBRARY schemas: the two
# operators torchvision._meta_registrations registers a fake kernel for whether or not _C loaded.
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # the torch.library.Library holding the definitions (kept alive with the process)


def wheel_path() -> Path:
    base = os.environ.get("SPARKCACHE_TEST_WHEELS")
    return (Path(base) if base else REPO / ".cache" / "wheels") / WHEEL


def unpacked() -> Path:
    """The wheel unpacked into ``.cache/torchvision-VERSION`` (once; atomically renamed into place)."""
    from testing.tinymodel import _build_once

    wheel = wheel_path()
    out = REPO / ".cache" / f"torchvision-{VERSION}"
    if (out / ".complete").exists():
        return out
    if not wheel.is_file():
        raise FileNotFoundError(
            f"{wheel} is missing: run `make test-wheels` (torchvision {VERSION}'s wheel from PyPI, "
            "pinned by hash in requirements/test-wheels.txt)")

    def write(tmp: Path) -> None:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)

    return Path(_build_once(out, WHEEL, write))


def prepare() -> None:
    """Define the two operators' schemas and put the unpacked wheel first on ``sys.path``, so the
    next ``import torchvision`` works. Idempotent."""
    global _library
    import torch

    where = str(unpacked())
    if where not in sys.path:
        sys.path.insert(0, where)
    if _library is None:
        _library = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            _library.define(schema)


def install():
    """Make ``import torchvision`` work in this process (see the module's doc); returns the module.
    Idempotent. Call before anything imports torchvision."""
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    prepare()
    import torchvision

    assert torchvision.__version__.split("+")[0] == VERSION, torchvision.__file__
    assert not torchvision.extension._has_ops()  # a CPU build in the path would need no shim
    return torchvision


def install_for_vllm():
    """:func:`install`, and the same for the subprocesses vLLM starts to inspect a model class
    (its registry's ``_SUBPROCESS_COMMAND``, which it leaves to be changed). Returns the module."""
    module = install()
    from vllm.model_executor.models import registry

    registry._SUBPROCESS_COMMAND = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); "
                                    "from testing.torchvision_shim import install; install(); "
                                    "from vllm.model_executor.models.registry import _run; _run()"]
    return module


_SITECUSTOMIZE = """\
# Written by testing/torchvision_shim.py (site_dir): the first ``import torchvision`` of any
# process started with this folder on PYTHONPATH goes through the shim. Nothing else is imported.
import sys


class _Shim:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            sys.path.insert(0, {repo!r})
            from testing.torchvision_shim import prepare

            prepare()
        return None  # the path finders that follow find it


sys.meta_path.insert(0, _Shim())
"""


def site_dir() -> Path:
    """A folder holding a ``sitecustomize.py`` that runs :func:`prepare` in any process started
    with the folder on ``PYTHONPATH``, at its first ``import torchvision`` (so an engine life's
    processes, and the subprocesses vLLM starts to inspect a model class, import torchvision
    through the shim). Written once."""
    from testing.tinymodel import _build_once

    text = _SITECUSTOMIZE.format(repo=str(REPO))
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    return Path(_build_once(REPO / ".cache" / f"torchvision-site-{key}", "sitecustomize",
                            lambda tmp: (tmp / "sitecustomize.py").write_text(text)))
