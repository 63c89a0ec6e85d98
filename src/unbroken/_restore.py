"""Restoring a checkpoint's entries in place, with errors that say what differs.

Modules and optimizers are compared with the checkpoint *before* anything is restored, so a
model whose shapes changed gives "parameter 'fc.weight' has shape (10, 64) in the checkpoint and
(10, 32) now" rather than a stack trace from inside torch; any other ``load_state_dict`` that
fails becomes a ``ValueError`` naming its entry (and the entries already restored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ._state import has_state


def restore(state: dict, saved: dict, entries: dict, path: Path) -> None:
    missing = [name for name in state if name not in saved]
    if missing:
        raise ValueError(
            f"checkpoint {path} has no entry {', '.join(map(repr, missing))} (it holds "
            f"{sorted(saved)}); ask for the names that were saved, or leave these out of the "
            "state given to load_latest")
    # Everything that can be checked is checked first: a mismatch changes nothing.
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            _check_module(name, obj, saved[name])
        elif isinstance(obj, torch.optim.Optimizer):
            _check_optimizer(name, obj, saved[name], entries[name].get("param_shapes"))
    done = []
    for name, obj in [(n, o) for n, o in state.items() if has_state(o)]:
        try:
            obj.load_state_dict(saved[name])
        except Exception as error:
            partly = (f" {done} were restored already, so the state is now partly restored: "
                      "do not train on with it." if done else "")
            raise ValueError(
                f"state[{name!r}]: {type(obj).__qualname__}.load_state_dict rejected the entry "
                f"saved in {path}: {str(error).rstrip('.')}.{partly}") from error
        done.append(name)
    for name in state:
        if not has_state(state[name]):
            state[name] = saved[name]


def _shape(tensor: torch.Tensor) -> str:
    return str(tuple(tensor.shape))


def _check_module(name: str, module: torch.nn.Module, saved: Any) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"state[{name!r}]: the checkpoint holds a {type(saved).__name__}, "
                         f"not the state_dict of a {type(module).__qualname__}")
    current = module.state_dict()
    params = {key for key, _ in module.named_parameters(remove_duplicate=False)}
    problems = [
        f"{'parameter' if key in params else 'buffer'} {key!r} has shape {_shape(saved[key])} "
        f"in the checkpoint and {_shape(now)} now"
        for key, now in current.items()
        if key in saved and isinstance(now, torch.Tensor) and isinstance(saved[key], torch.Tensor)
        and saved[key].shape != now.shape]
    if len(problems) > 5:  # a changed width touches every layer: the first few say enough
        problems[5:] = [f"{len(problems) - 5} more tensors differ in shape"]
    absent = [key for key in current if key not in saved]
    extra = [key for key in saved if key not in current]
    if absent:
        problems.append(f"keys of the module missing from the checkpoint: {absent}")
    if extra:
        problems.append(f"keys in the checkpoint that the module lacks: {extra}")
    if problems:
        raise ValueError(f"state[{name!r}]: the checkpoint does not fit this "
                         f"{type(module).__qualname__}: " + "; ".join(problems) +
                         ". Build the model as the run that saved it did.")


def _check_optimizer(name: str, optimizer, saved: Any, shapes: list | None) -> None:
    try:
        sizes = [len(group["params"]) for group in saved["param_groups"]]
    except (KeyError, TypeError):
        raise ValueError(f"state[{name!r}]: the checkpoint does not hold an optimizer's "
                         "state_dict (no 'param_groups' with 'params')") from None
    now = [len(group["params"]) for group in optimizer.param_groups]
    if sizes != now:
        raise ValueError(
            f"state[{name!r}]: the checkpoint has {len(sizes)} parameter groups of sizes {sizes}, "
            f"this optimizer has {len(now)} of sizes {now}; build it over the same parameters")
    for g, group in enumerate(optimizer.param_groups if shapes else ()):
        for i, param in enumerate(group["params"]):
            if list(param.shape) != shapes[g][i]:
                raise ValueError(
                    f"state[{name!r}]: parameter {i} of group {g} has shape {tuple(shapes[g][i])} "
                    f"in the checkpoint and {_shape(param)} now; build the model as the run that "
                    "saved it did")
