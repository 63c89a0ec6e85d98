"""One step of the Trainer's loop: the user's step functions and the optimizer step.

``step_function`` turns ``model.training_step`` into a step function when ``fit`` is given none;
``loss_and_logs`` reads what a step returned (a loss tensor, or a dict with ``"loss"``);
``optimizer_step`` ends an accumulation window: unscale, clip, step, zero the gradients and
step a per-step scheduler. No host syncs here: the loop reads ``loss.item()`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

StepFn = Callable[[torch.nn.Module, Any], Any]


def step_function(model: torch.nn.Module, name: str) -> StepFn:
    """``model.<name>(batch)`` as a step function, for a ``fit`` given no ``<name>=``."""
    method = getattr(model, name, None)
    if not callable(method):
        raise TypeError(f"pass {name}=fn(model, batch) to fit(), or give the model a {name}(batch)")
    return lambda _model, batch: method(batch)


def loss_and_logs(output: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """A step's loss tensor and its other scalars (floats) to log."""
    if isinstance(output, torch.Tensor):
        return output, {}
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        logs = {
            k: float(v.detach() if isinstance(v, torch.Tensor) else v)
            for k, v in output.items()
            if k != "loss"
        }
        return output["loss"], logs
    raise TypeError(
        "a step function must return the loss tensor or a dict with a 'loss' tensor and other "
        f"scalars to log; got {type(output).__name__}"
    )


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scaler: Any,
    scheduler: Any,
    clip_grad_norm: float | None,
) -> None:
    """Step ``optimizer`` on the accumulated gradients; ``scheduler``: a per-step one, or None."""
    if clip_grad_norm is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
