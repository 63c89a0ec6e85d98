"""``exact_reduce``: DDP gradients whose sum does not depend on DDP's bucket layout.

**Why.** ``DistributedDataParallel`` all-reduces gradients in buckets. A process's first
iteration uses buckets in parameter order; after it, DDP rebuilds them in the order the
gradients became ready. On 3 or more ranks a ring all-reduce sums an element in an order that
depends on its offset in the bucket (on 2, each element is one addition, ``a + b == b + a``).
A resumed process runs its first step in the first layout where the uninterrupted run used the
rebuilt one, so its weights drift by about 1e-8: no error, other numbers.

**How.** A communication hook (``ExactReduction``) that never reduces DDP's buckets as they
are. The parameters are split once into fixed *chunks*: consecutive parameters in the
module's order, of one dtype and device, up to ``chunk_mb``. When every gradient of a chunk is
in its bucket, the chunk is copied into one flat tensor in that fixed order, divided by the
world size, all-reduced, and copied back. Each element is then summed in the same order at
every step of every process, whatever the buckets hold. Every rank reaches the chunks in the
same order, since DDP gives every rank the same buckets.

**Cost.** One extra copy of the gradients each way, and the chunks' all-reduces. Those are as
many bytes as DDP's own, in about as many collectives. Each all-reduce blocks the backward on a
CPU (gloo); on a GPU, NCCL orders it on the stream and the host goes on.

**Scope.** Dense gradients of one DDP model; sparse gradients are refused. ``Trainer``
registers it on a DDP model of 3 or more ranks; ``lightning.ExactResume`` does the same for
Lightning's DDP. In your own loop, call ``exact_reduce(model)`` once, after wrapping the model.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations with the real
# GradBucket and Future types, and a string annotation fails that check.

import logging
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

_EXACT: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models exact_reduce set up
_WARNED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models warned about


class InexactReduction(UserWarning):
    """A DDP model on 3 or more ranks whose resumed steps may differ in the last bits."""


class ExactReduction:
    """The state of the hook: the fixed chunks of one DDP model's parameters (see the module).

    Args:
        parameters: The parameters DDP reduces, in the module's order.
        group: The process group DDP reduces over (None: the default group).
        chunk_mb: The most megabytes of gradients in one all-reduce.
    """

    def __init__(
        self, parameters: Sequence[torch.Tensor], group: Any = None, chunk_mb: float = 25.0
    ) -> None:
        if chunk_mb <= 0:
            raise ValueError(f"chunk_mb must be > 0, got {chunk_mb!r}")
        self.group = group
        self.chunks: list[list[torch.Tensor]] = []
        # Chunks are filled from the module's end: gradients become ready roughly from the
        # last layer to the first, so the chunk completed last (the first layers') is the
        # remainder, the smallest, and the least all-reduce waits after the backward.
        cap, size, key = chunk_mb * 2**20, 0.0, None
        for parameter in reversed(parameters):
            if parameter.layout != torch.strided:
                raise ValueError("exact_reduce takes dense parameters only")
            nbytes = parameter.numel() * parameter.element_size()
            this = (parameter.dtype, parameter.device)
            if not self.chunks or this != key or size + nbytes > cap and size > 0:
                self.chunks.append([])
                key, size = this, 0.0
            self.chunks[-1].append(parameter)
            size += nbytes
        self.chunks = [chunk[::-1] for chunk in reversed(self.chunks)]  # the module's order
        self.where: dict[int, int] = {
            id(p): index for index, chunk in enumerate(self.chunks) for p in chunk
        }
        # Per iteration: each chunk's gradients seen so far (None once it is sent), and a
        # future set once it is reduced and copied back into its buckets.
        self._views: list[dict[int, torch.Tensor] | None] = [{} for _ in self.chunks]
        self._done: list[torch.futures.Future[None]] = []

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Take this bucket's gradients and all-reduce each chunk they complete; the future
        is the bucket's buffer once every chunk with a gradient in it is reduced."""
        if bucket.index() == 0:  # a new iteration: DDP hands the buckets over in order
            self._views = [{} for _ in self.chunks]
            self._done = [torch.futures.Future() for _ in self.chunks]
        touched: list[int] = []
        for parameter, gradient in zip(bucket.parameters(), bucket.gradients()):
            chunk = self.where.get(id(parameter))
            if chunk is None:
                raise RuntimeError(
                    f"exact_reduce: DDP reduces a parameter of shape {tuple(parameter.shape)} "
                    "that its model's named_parameters() did not list; register the hook with "
                    "exact_reduce(model) on the DistributedDataParallel model itself"
                )
            views = self._views[chunk]
            if views is None:
                raise RuntimeError(
                    "exact_reduce: a parameter's gradient came twice in one iteration"
                )
            views[id(parameter)] = gradient
            if chunk not in touched:
                touched.append(chunk)
            if len(views) == len(self.chunks[chunk]):
                self._all_reduce(chunk)
        if bucket.is_last():
            missing = [i for i, views in enumerate(self._views) if views is not None]
            if missing:
                raise RuntimeError(
                    f"exact_reduce: chunks {missing} never had all their gradients: DDP does not "
                    "reduce every parameter exact_reduce expected (parameters_to_ignore changed "
                    "after the model was wrapped?)"
                )
        buffer = bucket.buffer()

        def reduced(chunks: torch.futures.Future[list[torch.futures.Future[None]]]) -> torch.Tensor:
            for done in chunks.value():
                done.wait()  # raises what the chunk's all-reduce raised
            return buffer

        return torch.futures.collect_all([self._done[c] for c in touched]).then(reduced)

    def _all_reduce(self, chunk: int) -> None:
        views, done = self._views[chunk], self._done[chunk]
        assert views is not None
        self._views[chunk] = None
        ordered = [views[id(p)] for p in self.chunks[chunk]]
        flat = torch.cat([view.reshape(-1) for view in ordered])
        flat.div_(dist.get_world_size(self.group))
        if flat.is_cuda:  # NCCL orders it on the stream, the copies after it: the host goes on
            dist.all_reduce(flat, group=self.group)
            _unflatten(flat, ordered)
            done.set_result(None)
            return

        # gloo: in the background, the copies back as it completes; the backward goes on.
        def finish(work: torch.futures.Future[Any]) -> None:
            try:
                work.wait()
                _unflatten(flat, ordered)
                done.set_result(None)
            except Exception as error:
                done.set_exception(error)  # type: ignore[arg-type]  # torch's stub: T, not an error

        dist.all_reduce(flat, group=self.group, async_op=True).get_future().then(finish)


def _unflatten(flat: torch.Tensor, views: list[torch.Tensor]) -> None:
    offset = 0
    for view in views:
        view.copy_(flat[offset : offset + view.numel()].view_as(view))
        offset += view.numel()


def exact_allreduce_hook(
    state: ExactReduction, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook of ``ExactReduction`` (``state``); see the module."""
    return state.reduce(bucket)


def exact_reduce(model: DistributedDataParallel, chunk_mb: float = 25.0) -> DistributedDataParallel:
    """Make a DDP model's gradient reduction exact across resumes, on any number of ranks.

    Call it once, right after wrapping the model and before the first backward. It registers
    a communication hook (see the module), so DDP accepts no other hook on this model.

    Args:
        model: The ``DistributedDataParallel`` model.
        chunk_mb: The most megabytes of gradients in one all-reduce.

    Returns:
        ``model``, for ``model = exact_reduce(DDP(net))``.

    Raises:
        TypeError: ``model`` is not a ``DistributedDataParallel``.
        RuntimeError: the model already has a communication hook (DDP takes one).

    Example::

        model = exact_reduce(DistributedDataParallel(net))
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"exact_reduce takes a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(model).__name__}: wrap the model in DDP first"
        )
    if model in _EXACT:
        return model
    ignored: set[str] = getattr(model, "parameters_to_ignore", set())
    parameters = [
        p for name, p in model.module.named_parameters() if p.requires_grad and name not in ignored
    ]
    state = ExactReduction(parameters, group=model.process_group, chunk_mb=chunk_mb)
    try:
        model.register_comm_hook(state, exact_allreduce_hook)
    except RuntimeError as error:
        raise RuntimeError(
            "exact_reduce: this DDP model already has a communication hook, and DDP takes one. "
            "Remove yours, or make sure it sums each element in an order that does not depend "
            f"on DDP's buckets ({error})"
        ) from error
    _EXACT.add(model)
    return model


def is_exact(model: Any) -> bool:
    """Whether a resumed step of ``model`` sums its gradients as the uninterrupted run did:
    anything but DDP, DDP on 1 or 2 ranks, DDP with ``exact_reduce``, or DDP that never
    rebuilds its buckets (``find_unused_parameters=True`` without ``static_graph``)."""
    if not isinstance(model, DistributedDataParallel) or model in _EXACT:
        return True
    if dist.get_world_size(model.process_group) <= 2:
        return True
    return bool(model.find_unused_parameters and not model.static_graph)


def ensure_exact(model: Any, who: str) -> None:
    """For a loop that owns the model's steps (``Trainer``, ``ExactResume``): register
    ``exact_reduce`` on a DDP model that needs it, or warn (``InexactReduction``) that its
    resumed steps may differ in the last bits when it cannot (another hook is registered)."""
    if is_exact(model):
        return
    try:
        exact_reduce(model)
        log.info("%s: DDP gradients are reduced in fixed chunks (exact_reduce)", who)
    except RuntimeError as error:
        warn_inexact(who, model, why=str(error))


def warn_inexact(who: str, model: Any, why: str = "") -> None:
    """Say, once per model, that a DDP model on 3 or more ranks may not resume bit for bit."""
    if model in _WARNED:
        return
    _WARNED.add(model)
    warnings.warn(
        f"{who}: a DistributedDataParallel model on 3 or more ranks reduces the first step "
        "after a resume in another bucket layout than the uninterrupted run, so the weights "
        "differ in the last bits. Call unbroken.distributed.exact_reduce(model) right after "
        f"wrapping it{'; ' + why if why else ''}",
        InexactReduction,
        stacklevel=3,
    )
