"""The seams issue 9 introduced: the one epoch protocol, the source protocol, the named seed
keys, the error types and the state versions. Each test fails if its seam is broken."""

import importlib
import itertools
import pickle

import pytest
import torch
from locations import ROOT
from pipelines import Augmented, Positioned

import unbroken
from unbroken.data import keys
from unbroken.data.epochs import EpochIterable
from unbroken.data.keys import derive_key
from unbroken.data.sources import SOURCES, register
from unbroken.data.sources.base import BatchSource
from unbroken.data.sources.orders import IndexSource
from unbroken.errors import CorruptState, StateMismatch
from unbroken.testing import assert_resumes_exactly


class Countdown(EpochIterable[list]):
    """The example of epochs.py's docstring, with a state: three items per epoch."""

    def __init__(self):
        self._init_epochs()

    def _start_position(self, ended):
        return [0]

    def _run(self, position, epoch):
        for value in range(position[0], 3):
            position[0] = value + 1
            yield (epoch, value)

    def state_dict(self):
        return {"epoch": self.epoch, "received": self._pos[0]}

    def load_state_dict(self, state):
        self._restore(state["epoch"], [state["received"]])


def test_a_new_iterable_gets_the_whole_epoch_protocol_from_the_base_class():
    stream = Countdown()
    iter(stream)  # yields nothing: starts nothing
    assert stream.epoch == 0
    assert list(stream) == [(0, 0), (0, 1), (0, 2)]
    assert stream.epoch == 1
    for _ in stream:  # a break after one item ends epoch 1 at once
        break
    assert stream.state_dict() == {"epoch": 2, "received": 0}
    held = iter(stream)
    next(held)
    assert stream.state_dict() == {"epoch": 2, "received": 1}  # what was received
    assert list(stream) == [(3, 0), (3, 1), (3, 2)]  # a new iter() ended the held one's epoch
    stream.set_epoch(7)
    assert list(stream) == [(7, 0), (7, 1), (7, 2)]
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        stream.set_epoch(-1)
    assert assert_resumes_exactly(Countdown, epochs=3) == 1 + 3 * 4


def test_a_stale_iteration_changes_nothing():
    stream = Countdown()
    old = iter(stream)
    next(old)
    stream.set_epoch(5)
    assert list(old) == [(0, 1), (0, 2)]  # it may finish, but it is not the current epoch
    assert stream.epoch == 5 and stream.state_dict()["received"] == 0
    assert list(stream) == [(5, 0), (5, 1), (5, 2)]


def test_an_iterator_takes_its_position_at_its_first_item():
    # Code that calls iter() and then set_epoch() or load_state_dict() (Lightning does when it
    # resumes) gets what it set, as with torch's samplers, which are generators too.
    stream = Countdown()
    iterator = iter(stream)
    stream.set_epoch(4)
    assert list(iterator) == [(4, 0), (4, 1), (4, 2)]
    iterator = iter(stream)
    stream.load_state_dict({"epoch": 7, "received": 2})
    assert list(iterator) == [(7, 2)]
    assert stream.epoch == 8


class Halved(Augmented):
    """A dataset that only ``EveryOther`` reads."""


class EveryOther(IndexSource):
    """The example of sources/base.py's docstring: the even positions of [0, n), one per batch."""

    @classmethod
    def matches(cls, arguments):
        return isinstance(arguments.dataset, Halved)

    @classmethod
    def build(cls, arguments):
        return cls(len(arguments.dataset))

    def __init__(self, n):
        super().__init__()
        self.n = n

    def __len__(self):
        return (self.n + 1) // 2

    def fingerprint(self):
        return {"sampler": "every-other", "shuffle": None}

    def check_cursor(self, cursor, what):
        if (
            cursor.source is not None
            or cursor.samples != cursor.batches
            or cursor.batches > len(self)
        ):
            raise CorruptState(f"{what} state is inconsistent")

    def batches(self, seed, epoch, cursor, done):
        key = keys.samples(seed, epoch)
        for k in range(cursor.samples, len(self)):
            done.append((k + 1, None))
            yield [2 * k], key, k


@pytest.fixture
def every_other():
    register(EveryOther, first=True)
    yield EveryOther
    SOURCES.remove(EveryOther)


@pytest.mark.parametrize("workers", [0, 2])
def test_adding_a_source_is_one_class(every_other, workers):
    def make():
        return unbroken.DataLoader(Halved(9), batch_size=1, num_workers=workers, seed=4)

    batches = list(make())
    assert [int(b["index"]) for b in batches] == [0, 2, 4, 6, 8]
    assert list(make().sampler) == [0, 2, 4, 6, 8]  # torch's loader.sampler lists its order
    assert assert_resumes_exactly(make, epochs=2, cuts=range(0, 13, 3 if workers else 1))
    # Other datasets still get the built-in sources.
    assert len(list(unbroken.DataLoader(Augmented(9), batch_size=1, seed=4))) == 9


def test_a_registered_source_must_say_what_it_reads():
    class Unsaid(BatchSource):
        pass

    register(Unsaid, first=True)
    try:
        with pytest.raises(NotImplementedError, match="define the classmethod matches"):
            unbroken.DataLoader(Halved(4), seed=0)
    finally:
        SOURCES.remove(Unsaid)
    with pytest.raises(TypeError, match="BatchSource subclass"):
        register(Halved)


def test_no_two_purposes_share_a_key_tuple():
    # The old layout keyed stream worker w as (seed, epoch, w): the shuffle's key for w = 1 and
    # the worker seeds' for w = 2. Every purpose now has its own tuple.
    seed, epoch = 5, 3
    per_purpose = {
        "samples": {keys.samples(seed, epoch)},
        "shuffle": {keys.shuffle(seed, epoch)},
        "torch_workers": {keys.torch_workers(seed, epoch)},
        "stream_worker": {keys.stream_worker(seed, epoch, w) for w in range(8)},
        "window": {keys.window(seed, epoch, w) for w in range(8)},
    }
    for (a, ka), (b, kb) in itertools.combinations(per_purpose.items(), 2):
        assert not ka & kb, f"{a} and {b} share a key"
    # The three map-style keys are those of state version 1.
    assert keys.samples(seed, epoch) == derive_key(seed, epoch)
    assert keys.shuffle(seed, epoch) == derive_key(seed, epoch, 1)
    assert keys.torch_workers(seed, epoch) == derive_key(seed, epoch, 2)


@pytest.mark.parametrize("version", [1, 2])
def test_a_state_seeded_per_sample_is_refused_and_says_why(version):
    # Versions 1 and 2 seeded the global generators per sample: the rest of their epoch would
    # draw other numbers now, so no resume could be exact.
    for dataset in (Augmented(6), Positioned(6)):
        state = unbroken.DataLoader(dataset, batch_size=2, seed=1).state_dict()
        assert state["version"] == 3
        state["version"] = version
        with pytest.raises(StateMismatch, match=f"version={version}.*once per batch") as error:
            unbroken.DataLoader(dataset, batch_size=2, seed=1).load_state_dict(state)
        assert (error.value.field, error.value.saved, error.value.current) == (
            "version",
            version,
            3,
        )


def test_a_version_1_shuffle_buffer_state_is_refused():
    state = unbroken.shuffle_buffer(list(range(8)), 3, seed=2).state_dict()
    assert state["version"] == 2
    state["version"] = 1
    with pytest.raises(StateMismatch, match="version=1"):
        unbroken.shuffle_buffer(list(range(8)), 3, seed=2).load_state_dict(state)


def test_mismatched_and_corrupt_states_raise_their_own_types():
    make = lambda **kw: unbroken.DataLoader(Augmented(10), **{"batch_size": 2, "seed": 3, **kw})
    state = make().state_dict()
    with pytest.raises(StateMismatch) as mismatch:
        make(batch_size=3).load_state_dict(state)
    assert (mismatch.value.field, mismatch.value.saved, mismatch.value.current) == (
        "batch_size",
        2,
        3,
    )
    bad = dict(state, samples=1)  # one sample in zero batches
    with pytest.raises(CorruptState):
        make().load_state_dict(bad)
    with pytest.raises(CorruptState, match="missing fields"):
        make().load_state_dict({k: v for k, v in state.items() if k != "epoch"})
    assert issubclass(StateMismatch, ValueError) and issubclass(CorruptState, ValueError)
    # A wrapper keeps its part's error type, with the part named in front.
    combined = lambda size: unbroken.CombinedLoader({"a": make(batch_size=size)})
    with pytest.raises(StateMismatch, match="loader 'a': .*batch_size=2"):
        combined(3).load_state_dict(combined(2).state_dict())


def test_an_error_raised_in_a_worker_keeps_its_type():
    # torch re-raises a worker's error as exc_type(message); StateMismatch takes a message alone.
    class Shrinking(torch.utils.data.IterableDataset):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(self.n))

    saved = unbroken.DataLoader(Shrinking(8), batch_size=2, num_workers=1, seed=1)
    it = iter(saved)
    for _ in range(3):
        next(it)
    state = saved.state_dict()
    del it
    resumed = unbroken.DataLoader(Shrinking(2), batch_size=2, num_workers=1, seed=1)
    with pytest.warns(UserWarning, match="re-reads"):
        resumed.load_state_dict(state)
    with pytest.raises(StateMismatch, match="yields only 2"):
        list(resumed)
    assert str(StateMismatch("the whole message")) == "the whole message"
    error = StateMismatch("unbroken.DataLoader", "seed", 1, 2)
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.field, copy.saved, copy.current, str(copy)) == (
        StateMismatch,
        "seed",
        1,
        2,
        str(error),
    )


def test_set_epoch_on_a_combined_loader_moves_children_left_mid_epoch():
    children = [unbroken.DataLoader(list(range(4)), batch_size=1, seed=s) for s in (1, 2)]
    combined = unbroken.CombinedLoader(children, mode="min_size")
    held = iter(combined)
    next(held)
    assert [child.epoch for child in children] == [0, 0]
    combined.set_epoch(5)
    assert combined.epoch == 5 and combined.state_dict()["batches"] == 0
    assert [child.epoch for child in children] == [1, 1]  # as at the end of a combined epoch


@pytest.mark.parametrize("make", ["loader", "combined"])
def test_a_batch_the_user_dropped_is_freed_at_once(make):
    import weakref

    class Box:
        pass

    refs = []

    def collate(samples):
        box = Box()
        refs.append(weakref.ref(box))
        return box

    loader = unbroken.DataLoader(list(range(6)), batch_size=2, collate_fn=collate, seed=1)
    iterable = loader if make == "loader" else unbroken.CombinedLoader([loader], "max_size")
    iterator = iter(iterable)
    first = next(iterator)
    assert refs[0]() is not None
    del first
    assert refs[0]() is None  # neither the loader nor the epoch machinery holds it
    next(iterator)


def _package_imports() -> dict[str, set[str]]:
    """Which parts of unbroken each part imports, read from the sources (``import`` statements
    anywhere, those inside functions too). A part is a subpackage (``data``, ``train``, ...) or
    a top-level module (``errors``, ``preemption``, ...)."""
    import ast
    from pathlib import Path

    root = Path(unbroken.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        relative = path.relative_to(root).with_suffix("").parts
        part = relative[0]
        package = relative[:-1] if path.name != "__init__.py" else relative[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [target] if target else [[alias.name] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("unbroken."):
                names = [node.module.split(".")[1:]]
            elif isinstance(node, ast.Import):
                names = [
                    a.name.split(".")[1:] for a in node.names if a.name.startswith("unbroken.")
                ]
            else:
                continue
            for target in names:
                if target and target[0] != part:
                    graph.setdefault(part, set()).add(target[0])
    return graph


def test_the_packages_import_each_other_without_a_cycle():
    graph = _package_imports()
    assert "distributed" in graph["data"]  # the graph is read: data asks World for the ranks

    def cycle_from(node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                return [*path[path.index(nxt) :], nxt]
            found = cycle_from(nxt, [*path, nxt])
            if found:
                return found
        return None

    for start in sorted(graph):
        cycle = cycle_from(start, [start])
        assert cycle is None, f"unbroken's parts import each other in a cycle: {' -> '.join(cycle)}"
    # The layers, lowest first: each imports only from those below it.
    assert not graph.get("distributed", set()) - {"errors", "_checks"}
    assert "train" not in graph["data"] and "data" not in graph.get("checkpoint", set())


def test_no_module_grows_past_a_reading():
    # A module is sized by its concern, not by a line count; past about 600 lines it likely holds
    # more than one, and is looked at.
    from pathlib import Path

    package = Path(unbroken.__file__).parent
    long = {
        str(path.relative_to(package)): n
        for path in sorted(package.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 600
    }
    assert not long, f"modules to look at, by concern: {long}"


def test_the_modules_mutation_testing_names_exist():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = ROOT
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]
    missing = [path for path in config["only_mutate"] if not (root / path).is_file()]
    assert not missing, f"pyproject.toml's [tool.mutmut] names modules that are gone: {missing}"


def test_the_public_names_are_sorted_and_the_demos_import_only_them():
    import ast

    assert unbroken.__all__ == sorted(unbroken.__all__)
    demos = ROOT / "demo"
    for demo in sorted(demos.glob("*.py")):
        for node in ast.walk(ast.parse(demo.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("unbroken"):
                offered = importlib.import_module(node.module).__all__
                unknown = [a.name for a in node.names if a.name not in offered]
                assert node.module.count(".") <= 1 and not unknown, (
                    f"{demo.name} imports {unknown} from {node.module}: demos use public names"
                )
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "unbroken":
                    assert node.attr in unbroken.__all__ or node.attr in (
                        "distributed",
                        "streaming",
                        "testing",
                    ), f"{demo.name} uses unbroken.{node.attr}, not a public name"


def test_each_public_name_has_one_home():
    # A public object is offered by one subpackage's __all__ (its home); the top-level package
    # re-exports some of them for convenience, each the very object of its home. An object in
    # two homes is two answers to "where does this live" (unbroken.hf.Trainer is another
    # object than unbroken.train.Trainer: a name of its own in its namespace).
    from test_docstrings import PACKAGES

    homes: dict[tuple[str, int], list[str]] = {}
    for dotted in (*PACKAGES, "unbroken.errors"):
        if dotted == "unbroken":
            continue
        module = importlib.import_module(dotted)
        for name in module.__all__:
            assert hasattr(module, name), f"{dotted}.__all__ lists {name}, which it lacks"
            homes.setdefault((name, id(getattr(module, name))), []).append(dotted)
    twice = {name: where for (name, _), where in homes.items() if len(where) > 1}
    assert not twice, f"public objects offered by several subpackages: {twice}"
    for name in unbroken.__all__:
        home = homes.get((name, id(getattr(unbroken, name))))
        assert home, f"unbroken.{name} is not the object any subpackage offers under that name"
    offered = {name for (name, _), where in homes.items() if where != ["unbroken.testing"]}
    internal = {"MANIFEST", "S3Server"} & offered
    assert not internal, f"internals in a public namespace: {internal}"
