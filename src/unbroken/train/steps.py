"""One step of the Trainer's loop: the user's step functions, the callbacks' hooks and the
optimizer step, and ``fit``'s loaders, checked where they are given.

``step_function`` turns ``model.training_step`` into a step function when ``fit`` is given none;
``step_loss`` and ``step_values`` read what a step returned (a loss tensor, or a dict with
``"loss"`` and other scalars); ``optimizer_step`` ends an accumulation window: unscale, clip,
step, zero the gradients and step a per-step scheduler. No host syncs here: values stay
tensors, and the loop's log reads them on the host only on the batches it writes.

``hooks`` looks the callbacks' hooks up once, before a loop; ``check_loaders`` refuses a loader
whose position cannot be saved. The Trainer's own options are checked in ``options``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._state import has_state

StepFn = Callable[[torch.nn.Module, Any], Any]


def step_function(model: torch.nn.Module, name: str) -> StepFn:
    """``model.<name>(batch)`` as a step function, for a ``fit`` given no ``<name>=``."""
    method = getattr(model, name, None)
    if not callable(method):
        raise TypeError(f"pass {name}=fn(model, batch) to fit(), or give the model a {name}(batch)")
    return lambda _model, batch: method(batch)


def step_loss(output: Any) -> torch.Tensor:
    """The loss tensor of what a step returned: the tensor itself, or the dict's ``"loss"``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            return loss
    raise TypeError(
        "a step function must return the loss tensor or a dict with a 'loss' tensor and other "
        f"scalars to log; got {type(output).__name__}"
    )


def step_values(output: Any) -> dict[str, Any]:
    """What to log of a step's ``output`` (checked by ``step_loss``): its loss first, as
    ``"loss"``, then its other scalars in their order; tensors are detached, not read."""
    if isinstance(output, torch.Tensor):
        return {"loss": output.detach()}
    values = {"loss": output["loss"], **output}  # "loss" keeps the first place, then the rest
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


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


def ready_scaler(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """After a resume: torch's GradScaler makes its scale tensor at its first ``scale()``, from
    the loaded state, and a run resumed at an epoch's end steps the window it left pending
    (partial gradients) before it scales any loss. Scaling a zero makes it now, changing
    nothing of the state."""
    if scaler is not None and scaler.is_enabled():
        device = next(
            (p.device for group in optimizer.param_groups for p in group["params"]),
            torch.device("cpu"),
        )
        scaler.scale(torch.zeros((), device=device))


def hooks(callbacks: Iterable[Any], hook: str) -> tuple[Callable[..., Any], ...]:
    """The ``hook`` methods of the callbacks that have one, in order (duck-typed): looked up
    once before a loop, so a batch with no callback for it costs an empty ``for``."""
    return tuple(method for c in callbacks if callable(method := getattr(c, hook, None)))


def call_hooks(callbacks: Iterable[Any], hook: str, trainer: Any, *args: Any) -> None:
    """Call ``hook(trainer, *args)`` on every callback that has it (duck-typed, in order)."""
    for method in hooks(callbacks, hook):
        method(trainer, *args)


def check_loaders(train_loader: Iterable, val_loader: Iterable | None) -> None:
    """A loader without ``state_dict`` would restart its epoch on resume: refuse it."""
    for loader, name in ((train_loader, "train_loader"), (val_loader, "val_loader")):
        if loader is not None and not has_state(loader):
            raise TypeError(
                f"{name} has no state_dict(), so its position cannot be saved and a resume "
                "would restart its epoch; use unbroken.DataLoader (or any loader with "
                "state_dict/load_state_dict)"
            )
