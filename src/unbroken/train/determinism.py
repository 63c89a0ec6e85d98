"""``Trainer(deterministic=...)``: the settings bit-exact resume needs on a GPU.

A resumed run equals the uninterrupted one only if every kernel gives the same bits for the
same inputs. CPU kernels do (for a fixed thread count); many CUDA kernels do not: cuBLAS picks
reduction orders by workspace, cuDNN benchmarks and may pick another algorithm after a restart,
and atomics-based kernels (scatter_add, index_add, some backward passes) add in any order.
``deterministic=True`` turns on ``torch.use_deterministic_algorithms`` (an op with no
deterministic kernel then raises instead of silently varying), sets
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when unset, and turns cuDNN benchmarking off; the previous
settings are put back when ``fit`` returns. It costs some GPU speed, nothing on CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .._log import logger

CUBLAS = "CUBLAS_WORKSPACE_CONFIG"


@contextlib.contextmanager
def determinism(wanted: bool | None, model: torch.nn.Module) -> Iterator[None]:
    if not wanted:
        if wanted is None and any(p.is_cuda for p in model.parameters()):
            logger.info(
                "the model is on CUDA and Trainer(deterministic=None): CUDA kernels "
                "may vary from run to run, so a resumed run may differ from an uninterrupted "
                "one in the last bits; pass deterministic=True for bit-exact resume"
            )
        yield
        return
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )
    if CUBLAS not in os.environ:
        if torch.cuda.is_initialized():
            # cuBLAS reads it when a handle is created; handles made already keep their setting.
            logger.info(
                f"deterministic=True set {CUBLAS}=:4096:8 after CUDA started; set "
                "it before the first CUDA call (e.g. in the environment) to be sure it holds"
            )
        os.environ[CUBLAS] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[2:]
