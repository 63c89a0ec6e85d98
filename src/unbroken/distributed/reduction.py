"""``exact_reduce``: DDP gradients whose sum does not depend on DDP's bucket layout.

**Why.** ``DistributedDataParallel`` all-reduces gradients in buckets. A process's first
iteration uses one layout (all the parameters in one bucket, by default); after it, DDP
rebuilds the buckets in the order the gradients became ready. On 3 or more ranks a ring
all-reduce sums an element in an order that depends on its offset in the bucket (on 2, each
element is one addition, ``a + b == b + a``). A resumed process runs its first step in the
first layout where the uninterrupted run used the rebuilt one, so its weights drift by about
1e-8: no error, other numbers.

**How.** A communication hook (``ExactReduction``) that sums every step of every process in
one layout, the rebuilt one, whatever DDP's buckets hold at that step. In a process's first
reduced backward (backwards under ``no_sync`` before it reduce nothing) it notes the order the
gradients become ready (``register_post_accumulate_grad_hook``), as DDP does for its rebuild,
and cuts that order into *chunks* exactly as DDP cuts its rebuilt buckets (``rebuilt_layout``:
the same size limits, the same rule). From then on:

- a bucket that holds one chunk, in its order (every bucket once DDP has rebuilt them), is
  divided by the world size and all-reduced in place: DDP's own reduction, no copy;
- any other bucket (the first step of every process) is copied into its chunks, each divided
  and all-reduced as one flat tensor, and copied back.

Both ways sum each element at the same offset of a tensor of the same length: the same bits.

**What it relies on in torch.** (1) The backward reaches the parameters in the same order in
every process of a run (DDP's rebuild relies on it too): a static graph. (2) A bucket's buffer
is its gradients, flat, in ``bucket.parameters()`` order, and an all-reduce's result depends
only on its input and length. (3) DDP divides by the world size before it sums (its default
hook does). Should DDP's rebuilt buckets not match the chunks (another torch's rule, several
dtypes), every step takes the copying way: exact still, slower, and said once in the log.

**The agreement's numbers.** Set up with ``carry_bytes`` (``ensure_exact``), the reduction
also sums a row of that many bytes over the ranks at every backward (``carry(row)`` before it,
``carried()`` after): the row rides at the end of one chunk's all-reduce, the smallest chunk of
a floating dtype, each byte one element of the chunk's dtype (exact: a sum of bytes stays an
integer far below the dtype's precision; saturated at 255). Every backward of every process
packs a row there, zeros if none was given, so that all-reduce has one length in both ways and
the sums do not depend on it. The Trainer's ranks agree on preemption, saves and losses that
way, with no collective of their own per step: one copy of the smallest chunk a step.

**Cost.** In steady state, DDP's own all-reduces plus one call of a Python hook a bucket
(``benchmarks/ddp_reduction.py``), and a pass over the gradients to divide them by the world
size, which DDP's C++ path fuses into its copy. A loop that divides its loss by the world size
instead saves that pass: set ``predivided`` (the Trainer does, without gradient accumulation).
One copy of the gradients each way in a process's first step.

**Scope.** Dense gradients of one DDP model. ``Trainer`` registers it on a DDP model of 2
or more ranks; ``lightning.ExactResume`` on Lightning's DDP of 3 or more. In your own loop,
call ``exact_reduce(model)`` once, after wrapping the model, before its first backward.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations with the real
# GradBucket and Future types, and a string annotation fails that check.

import logging
import warnings
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

_STATES: "weakref.WeakKeyDictionary[torch.nn.Module, ExactReduction]" = (
    weakref.WeakKeyDictionary()
)  # the models exact_reduce set up, and their hooks' states
_WARNED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models warned about
_FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's first bucket when bucket_cap_mb is left at its default


class InexactReduction(UserWarning):
    """A DDP model on 3 or more ranks whose resumed steps may differ in the last bits."""


def rebuilt_layout(sizes: Sequence[tuple[int, Any]], limits: Sequence[int]) -> list[list[int]]:
    """DDP's rebuilt buckets: the parameters in the order their gradients became ready, cut
    where a bucket's bytes reach its limit (``limits[0]`` for the first bucket of a dtype and
    device, the next for the next, the last for the rest); then the bucket left open for each
    (dtype, device), the one first seen last first.

    Args:
        sizes: For each parameter in ready order, its gradient's bytes and its (dtype, device).
        limits: The bucket size limits in bytes, as DDP's reducer holds them.

    Returns:
        The buckets, as indices into ``sizes``.
    """
    done: list[list[int]] = []
    open_: dict[Any, tuple[list[int], int, int]] = {}  # key: (indices, bytes, limit's index)
    for index, (nbytes, key) in enumerate(sizes):
        indices, size, which = open_.get(key, ([], 0, 0))
        indices.append(index)
        size += nbytes
        if size >= limits[which]:
            done.append(indices)
            open_[key] = ([], 0, min(which + 1, len(limits) - 1))
        else:
            open_[key] = (indices, size, which)
    # The open buckets last, the most recently opened key first: the order torch's reducer
    # walks its hash map in (libstdc++); another order would only cost a copy each step.
    done.extend(indices for indices, _, _ in reversed(open_.values()) if indices)
    return done


def bucket_limits(model: DistributedDataParallel) -> list[int]:
    """The size limits DDP's reducer cuts its rebuilt buckets by. DDP keeps them in attributes
    that changed across torch versions; a wrong guess costs speed only (see the module)."""
    config = getattr(model, "_bucket_config", None)
    if config is not None:  # torch 2.12 and later
        if config.per_bucket_bytes_caps:
            return list(config.per_bucket_bytes_caps)
        return [config.first_bucket_bytes_cap, config.bucket_bytes_cap]
    cap = int(model.bucket_bytes_cap)
    default = getattr(model, "bucket_bytes_cap_default", True)
    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", _FIRST_BUCKET_BYTES)
    return [first if default else cap, cap]


class ExactReduction:
    """The state of the hook (see the module): one DDP model's chunks, learnt in its first
    backward, and the numbers to carry with the next one.

    Args:
        parameters: The parameters DDP reduces, in the module's order.
        limits: DDP's bucket size limits in bytes (``bucket_limits``).
        group: The process group DDP reduces over (None: the default group).
        rebuilds: Whether DDP rebuilds its buckets after the first backward; if not, the
            first backward's buckets are the layout of every step, and each is reduced as is.
        carry_bytes: The width of the row each backward carries (0: none; see the module).
        predivided: The gradients arrive divided by the world size already: the hook only
            sums them, with no pass over the gradients to divide. Right only for a loop that
            scales its loss by ``1 / world size`` and reduces each backward's gradients alone
            (no gradient accumulation): the Trainer sets it so (an attribute) when it may.
    """

    def __init__(
        self,
        parameters: Sequence[torch.Tensor],
        limits: Sequence[int],
        group: Any = None,
        rebuilds: bool = True,
        carry_bytes: int = 0,
        predivided: bool = False,
    ) -> None:
        for parameter in parameters:
            if parameter.layout != torch.strided:
                raise ValueError("exact_reduce takes dense parameters only")
        self.parameters = list(parameters)
        self.limits, self.group, self.rebuilds = list(limits), group, rebuilds
        self.size = dist.get_world_size(group)
        # The chunks, once learnt: DDP's first buckets if it never rebuilds them (learnt
        # as they come), else cut from the first backward's ready order.
        self.chunks: list[list[torch.Tensor]] | None = None if rebuilds else []
        self._learning = not rebuilds
        self.where: dict[int, int] = {}  # id(parameter) -> its chunk
        self.copied = 0  # backwards that took the copying way (tests, benchmarks)
        self.carry_bytes, self.predivided = carry_bytes, predivided
        self.target: int | None = None  # the chunk the row rides with, once chunks are learnt
        self._known: dict[tuple[int, ...], int] = {}  # a bucket's key -> its chunk, or -1
        # The ready order of the backward in progress, as module indices: a backward under
        # no_sync reduces nothing and calls no hook, so the first reduced one's order is kept.
        self._ready: list[int] = []
        self._readied: set[int] = set()
        self._hooks: list[Any] = []
        if rebuilds:
            for i, parameter in enumerate(self.parameters):
                self._hooks.append(parameter.register_post_accumulate_grad_hook(self._noter(i)))
        # Per backward: the gradients of the chunks not reduced as a bucket, and a future per
        # bucket; the carried row (out: to send with the next backward; in: its sum, pending).
        self._views: dict[int, torch.Tensor] = {}
        self._pending: list[torch.futures.Future[None]] = []
        self._out: torch.Tensor | None = None
        self._packed: torch.Tensor | None = None  # the row's chunk and the row, reused
        self._sent: tuple[torch.futures.Future[Any], torch.Tensor] | None = None

    def _noter(self, index: int) -> Any:
        def note(_parameter: torch.Tensor) -> None:
            if index in self._readied:  # a gradient ready twice: a new backward began
                self._ready, self._readied = [], set()
            self._ready.append(index)
            self._readied.add(index)

        return note

    def close(self) -> None:
        """Remove the ready-order hooks (a model the hook could not be registered on)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def carry(self, row: torch.Tensor) -> None:
        """Sum ``row`` (``carry_bytes`` bytes, ``torch.uint8``) over the ranks with the next
        backward's reduction (see the module); ``carried()`` returns the sum after it."""
        if row.dtype != torch.uint8 or row.numel() != self.carry_bytes:
            raise ValueError(
                f"exact_reduce carries {self.carry_bytes} bytes (torch.uint8) a backward, "
                f"got {row.numel()} of {row.dtype}"
            )
        self._out, self._sent = row, None

    def carried(self) -> torch.Tensor | None:
        """The byte-wise sum over the ranks (at most 255) of what ``carry`` was given, if the
        last backward reduced it; else None (no backward reduced gradients since, or the last
        one was given no row).

        Raises:
            RuntimeError: the all-reduce that carried it failed.
        """
        sent, self._sent, self._out = self._sent, None, None
        if sent is None:
            return None
        reduced, tail = sent
        reduced.wait()  # done: DDP waited for it (with NCCL: ordered on the stream)
        return tail.clamp(max=255).to(torch.uint8)

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Reduce one bucket: as one all-reduce if it is a chunk, else through its chunks."""
        futures: list[torch.futures.Future[Any]] = []
        if bucket.index() == 0:
            self._views, self._pending = {}, []
        buffer = result = bucket.buffer()
        parameters = bucket.parameters()
        chunk = self._chunk_of(bucket.index(), parameters, buffer)
        if chunk is not None and chunk == self.target and self.carry_bytes:  # the row's chunk
            reduced, result = self._with_row(buffer)
            futures.append(reduced)
        elif chunk is not None:
            futures.append(self._all_reduce(self._divided(buffer)))
        else:
            for parameter, gradient in zip(parameters, bucket.gradients()):
                self._views[id(parameter)] = gradient
            done: torch.futures.Future[None] = torch.futures.Future()
            self._pending.append(done)
            futures.append(done)
        if bucket.is_last():
            self._learning = False
            if self._pending:
                self._reduce_by_chunks()
        if len(futures) == 1:  # every bucket past bucket 0, in steady state: one future
            return futures[0].then(partial(_done, result=result))
        return torch.futures.collect_all(futures).then(lambda all_: _first_error(all_, result))

    def _with_row(self, gradients: torch.Tensor) -> tuple[torch.futures.Future[Any], torch.Tensor]:
        """All-reduce a chunk's flat ``gradients``, divided, with the row after them: the one
        given to ``carry``, or zeros (the length never changes). Both ways of ``reduce`` come
        here, so the row's chunk is one all-reduce of one length in each.

        Returns:
            The all-reduce's future, and the divided gradients (a view of its tensor).
        """
        size = gradients.numel()
        # One buffer for every backward: a new one of a megabyte or more a step would be a
        # fresh mapping of zeroed pages each time. The last one is done with: DDP copied the
        # gradients out, and carried() copied the row's sum, before this backward began.
        packed = self._packed
        if (
            packed is None
            or packed.numel() != size + self.carry_bytes
            or packed.dtype != gradients.dtype
            or packed.device != gradients.device
        ):
            packed = self._packed = gradients.new_empty(size + self.carry_bytes)
        divided = packed[:size]
        if self.predivided:
            divided.copy_(gradients)
        else:
            torch.div(gradients, self.size, out=divided)
        row, self._out = self._out, None
        tail = packed[size:]
        if row is None:
            tail.zero_()
        else:
            tail.copy_(row)
        reduced = self._all_reduce(packed)
        # A backward that carried nothing leaves nothing to read: its zeros overwrote the tail.
        self._sent = (reduced, tail) if row is not None else None
        return reduced, divided

    def _chunk_of(
        self, index: int, parameters: list[torch.Tensor], buffer: torch.Tensor
    ) -> int | None:
        """The chunk this bucket is, its parameters in the chunk's order, its buffer nothing
        but their gradients; None if it is not one. Checked once per layout of a bucket (its
        key), since DDP changes a bucket only when it rebuilds them all."""
        if self._learning:  # DDP's buckets never change: the first backward's are the chunks
            self._learn([list(parameters)])
            return len(self.chunks or []) - 1
        if self.chunks is None:  # not learnt yet: the first backward takes the copying way
            return None
        key = (index, len(parameters), buffer.numel(), id(parameters[0]), id(parameters[-1]))
        known = self._known.get(key)
        if known is None:
            chunk = self.where.get(id(parameters[0]))
            members = self.chunks[chunk] if chunk is not None else []
            same = (
                len(members) == len(parameters)
                and all(a is b for a, b in zip(members, parameters))
                and buffer.numel() == sum(p.numel() for p in members)
            )
            known = chunk if same and chunk is not None else -1
            self._known[key] = known
        return None if known < 0 else known

    def _learn(self, buckets: list[list[torch.Tensor]]) -> None:
        chunks = self.chunks if self.chunks is not None else []
        for members in buckets:
            for parameter in members:
                self.where[id(parameter)] = len(chunks)
            chunks.append(members)
        self.chunks = chunks
        if self.target is None:  # the smallest chunk of a floating dtype (first, if learning)
            floating = [i for i, m in enumerate(chunks) if m[0].dtype.is_floating_point]
            if floating:
                self.target = min(floating, key=lambda i: sum(_nbytes(p) for p in chunks[i]))

    def _reduce_by_chunks(self) -> None:
        """The copying way, at the backward's last bucket: every chunk with a gradient copied
        here, flattened in its order, divided, all-reduced, and copied back."""
        self.copied += 1
        if self.chunks is None:
            self._learn_ready_order()
        assert self.chunks is not None
        if self.copied == 2:  # past a process's first backward: DDP's buckets are not the chunks
            log.info(
                "exact_reduce: DDP's buckets differ from the chunks it predicted; each step "
                "copies the gradients into them (exact, slower)"
            )
        unknown = [tuple(v.shape) for k, v in self._views.items() if k not in self.where]
        if unknown:
            raise RuntimeError(
                f"exact_reduce: DDP reduces gradients of shapes {unknown} that its model's "
                "named_parameters() did not list; register the hook with exact_reduce(model) "
                "on the DistributedDataParallel model itself"
            )
        works: list[torch.futures.Future[Any]] = []
        for index, members in enumerate(self.chunks):
            views = [self._views.get(id(p)) for p in members]
            if all(view is None for view in views):
                continue  # reduced as a bucket
            missing = [tuple(p.shape) for p, v in zip(members, views) if v is None]
            if missing:
                raise RuntimeError(
                    f"exact_reduce: parameters of shapes {missing} share a chunk with "
                    "gradients DDP reduced in another way; DDP's buckets changed after "
                    "exact_reduce learnt them (parameters_to_ignore changed?)"
                )
            present = [view for view in views if view is not None]
            flat = torch.cat([view.reshape(-1) for view in present])
            if index == self.target and self.carry_bytes:  # as reduce() does: the row after it
                reduced, flat = self._with_row(flat)
            else:
                reduced = self._all_reduce(self._divided(flat))
            works.append(reduced.then(partial(_unflatten, flat=flat, views=present)))

        pending = self._pending

        def finish(all_: torch.futures.Future[list[torch.futures.Future[Any]]]) -> None:
            try:
                for work in all_.value():
                    work.wait()  # raises what the chunk's all-reduce (or copy back) raised
            except Exception as raised:
                for done in pending:
                    done.set_exception(raised)  # type: ignore[arg-type]  # stub: T
                return
            for done in pending:
                done.set_result(None)

        torch.futures.collect_all(works).then(finish)

    def _learn_ready_order(self) -> None:
        for handle in self._hooks:
            handle.remove()  # once: the order of later backwards is DDP's rebuilt one
        self._hooks = []
        seen = set(self._ready)
        order = self._ready + [i for i in reversed(range(len(self.parameters))) if i not in seen]
        ordered = [self.parameters[i] for i in order]
        sizes = [(_nbytes(p), (p.dtype, p.device)) for p in ordered]
        self._learn([[ordered[i] for i in b] for b in rebuilt_layout(sizes, self.limits)])
        log.debug("exact_reduce: %d chunks in the gradients' ready order", len(self.chunks or []))

    def _divided(self, gradients: torch.Tensor) -> torch.Tensor:
        """``gradients``, divided by the world size in place unless they arrive so."""
        return gradients if self.predivided else gradients.div_(self.size)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future[Any]:
        return dist.all_reduce(tensor, group=self.group, async_op=True).get_future()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _done(reduced: torch.futures.Future[Any], result: torch.Tensor) -> torch.Tensor:
    reduced.wait()  # raises what the all-reduce raised
    return result


def _first_error(
    all_: torch.futures.Future[list[torch.futures.Future[Any]]], buffer: torch.Tensor
) -> torch.Tensor:
    for future in all_.value():
        future.wait()  # raises what the all-reduce raised
    return buffer


def _unflatten(
    reduced: torch.futures.Future[Any], flat: torch.Tensor, views: list[torch.Tensor]
) -> None:
    reduced.wait()  # raises what the all-reduce raised: nothing copied back from a failed one
    offset = 0
    for view in views:
        view.copy_(flat[offset : offset + view.numel()].view_as(view))
        offset += view.numel()


def exact_allreduce_hook(
    state: ExactReduction, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook of ``ExactReduction`` (``state``); see the module."""
    return state.reduce(bucket)


def exact_reduce(model: DistributedDataParallel) -> DistributedDataParallel:
    """Make a DDP model's gradient reduction exact across resumes, on any number of ranks.

    Call it once, right after wrapping the model and before the first backward. It registers
    a communication hook (see the module), so DDP accepts no other hook on this model. The
    reduction keeps DDP's buckets (``bucket_cap_mb``) and its speed once they are rebuilt.

    Args:
        model: The ``DistributedDataParallel`` model.

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
    return _register(model)


def _register(model: DistributedDataParallel, carry_bytes: int = 0) -> DistributedDataParallel:
    if model in _STATES:
        return model
    ignored: set[str] = getattr(model, "parameters_to_ignore", set())
    parameters = [
        p for name, p in model.module.named_parameters() if p.requires_grad and name not in ignored
    ]
    rebuilds = bool(model.static_graph or not model.find_unused_parameters)
    limits, group = bucket_limits(model), model.process_group
    state = ExactReduction(parameters, limits, group, rebuilds, carry_bytes)
    try:
        model.register_comm_hook(state, exact_allreduce_hook)
    except RuntimeError as error:
        state.close()
        raise RuntimeError(
            "exact_reduce: this DDP model already has a communication hook, and DDP takes one. "
            "Remove yours, or make sure it sums each element in an order that does not depend "
            f"on DDP's buckets ({error})"
        ) from error
    _STATES[model] = state
    return model


def reduction_of(model: Any) -> "ExactReduction | None":
    """The hook's state of a model ``exact_reduce`` set up, or None."""
    return _STATES.get(model) if isinstance(model, DistributedDataParallel) else None


def is_exact(model: Any) -> bool:
    """Whether a resumed step of ``model`` sums its gradients as the uninterrupted run did:
    anything but DDP, DDP on 1 or 2 ranks, DDP with ``exact_reduce``, or DDP that never
    rebuilds its buckets (``find_unused_parameters=True`` without ``static_graph``)."""
    if not isinstance(model, DistributedDataParallel) or model in _STATES:
        return True
    if dist.get_world_size(model.process_group) <= 2:
        return True
    return bool(model.find_unused_parameters and not model.static_graph)


def ensure_exact(model: Any, who: str, carry_bytes: int = 0) -> None:
    """For a loop that owns the model's steps (``Trainer``, ``ExactResume``): register
    ``exact_reduce`` on a DDP model that needs it (or, with ``carry_bytes``, on any DDP model of
    2 or more ranks, to carry the loop's agreement: a row that many bytes wide), or warn
    (``InexactReduction``) that its resumed steps may differ in the last bits when it cannot
    (another hook is registered)."""
    if not isinstance(model, DistributedDataParallel) or model in _STATES:
        return
    if is_exact(model) and not (carry_bytes and dist.get_world_size(model.process_group) > 1):
        return
    try:
        _register(model, carry_bytes)
        log.info("%s: DDP gradients are reduced in one layout at every step (exact_reduce)", who)
    except RuntimeError as error:
        if not is_exact(model):
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
