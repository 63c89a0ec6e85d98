"""A sharded dataset's index: what ``write_shards`` writes and ``index_parquet`` builds.

A sharded dataset is a directory (any fsspec URL) of Parquet files plus one small JSON file,
``unbroken-index.json``, written last, so a dataset whose writer died has no index and is
refused rather than read in part::

    {"format": "unbroken.shards", "version": 1, "rows": 200000,
     "columns": ["x", "y"],
     "shards": [{"name": "shard-00000.parquet", "rows": 7710, "row_groups": [964, ...],
                 "bytes": 8391012, "checksum": "sha256:9f2c..."}, ...]}

``checksum`` is ``sha256:`` of the whole file for shards ``write_shards`` wrote, and
``footer-sha256:`` of the Parquet footer (its metadata, length and magic: the file's last
bytes) for existing files that ``index_parquet`` indexed without reading them through
(``checksums=True`` hashes them whole instead). A downloaded shard is used only if its size
and checksum match; a footer checksum cannot see a flipped byte inside a data page, which the
index says by its kind.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import CorruptShard
from .remote import Remote

INDEX_NAME = "unbroken-index.json"
FORMAT, VERSION = "unbroken.shards", 1
_CHECKSUM_KINDS = ("sha256", "footer-sha256")
_CHUNK = 1 << 20


class Shard:
    """One Parquet file of the index: where its rows and row groups start."""

    __slots__ = ("bytes", "checksum", "name", "row_groups", "rows")

    def __init__(
        self, name: str, rows: int, row_groups: list[int], size: int, checksum: str
    ) -> None:
        self.name, self.rows, self.row_groups = name, rows, row_groups
        self.bytes, self.checksum = size, checksum

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rows": self.rows,
            "row_groups": self.row_groups,
            "bytes": self.bytes,
            "checksum": self.checksum,
        }


def checksum_of(path: str, kind: str) -> str:
    """``kind:hex`` of a local file, as the index records it."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        if kind == "footer-sha256":
            size = os.fstat(file.fileno()).st_size

            def read_end(count: int) -> bytes:
                file.seek(size - count)
                return file.read(count)

            digest.update(_footer(read_end, size) or b"")
        else:
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
    return f"{kind}:{digest.hexdigest()}"


def _footer(read_end: Callable[[int], bytes], size: int) -> bytes | None:
    """The Parquet footer of a file of ``size`` bytes (its metadata, their 4-byte length and
    ``PAR1``), from ``read_end(n)``, its last n bytes; None if it has none."""
    if size < 12:
        return None
    tail = read_end(8)
    length = int.from_bytes(tail[:4], "little")
    if tail[4:] != b"PAR1" or not 0 < length <= size - 12:
        return None
    return read_end(length + 8)


def fetch_index(remote: Remote) -> bytes:
    """The index of the dataset at ``remote``, as stored."""
    try:
        return remote.read(INDEX_NAME)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no sharded dataset at {remote.url}: {remote.where(INDEX_NAME)} does not exist. "
            "Write one with unbroken.streaming.write_shards, or index existing Parquet files "
            "with unbroken.streaming.index_parquet"
        ) from None


def read_index(where: str, raw: bytes) -> tuple[list[Shard], list[str], str]:
    """The shards and columns in the index ``raw`` (read from ``where``: the storage's URL, or
    the cache's local copy), and a digest of it (which the loader's fingerprint records: a
    state resumes only on the same dataset)."""
    try:
        index = json.loads(raw)
    except ValueError as error:
        raise CorruptShard(f"the index {where} is not valid JSON: {error}") from None

    def bad(message: str) -> CorruptShard:
        return CorruptShard(f"the index {where} is malformed: {message}")

    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise bad(f"expected format {FORMAT!r}, got {str(index)[:100]!r}")
    if index.get("version") != VERSION:
        raise bad(f"expected version {VERSION}, got {index.get('version')!r}")
    columns, entries = index.get("columns"), index.get("shards")
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise bad(f"'columns' must be a list of names, got {columns!r:.100}")
    if not isinstance(entries, list) or not entries:
        raise bad("'shards' must be a non-empty list")
    shards = []
    for i, entry in enumerate(entries):
        try:
            shard = Shard(
                entry["name"], entry["rows"], entry["row_groups"], entry["bytes"], entry["checksum"]
            )
        except (KeyError, TypeError):
            raise bad(f"shard {i} lacks one of name, rows, row_groups, bytes, checksum") from None
        counts = shard.row_groups
        ok = (
            isinstance(shard.name, str)
            and shard.name
            and not shard.name.startswith("/")
            and ".." not in shard.name.split("/")
            and _count(shard.rows)
            and _count(shard.bytes)
            and isinstance(counts, list)
            and all(_count(c) for c in counts)
            and sum(counts) == shard.rows
            and isinstance(shard.checksum, str)
            and shard.checksum.partition(":")[0] in _CHECKSUM_KINDS
        )
        if not ok:
            raise bad(f"shard {i} is inconsistent: {json.dumps(entry)[:300]}")
        shards.append(shard)
    if index.get("rows") != sum(s.rows for s in shards):
        raise bad(f"'rows' is {index.get('rows')!r}, the shards hold {sum(s.rows for s in shards)}")
    return shards, columns, hashlib.sha256(raw).hexdigest()[:16]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _write_index(remote: Remote, shards: list[Shard], columns: list[str]) -> dict[str, Any]:
    index = {
        "format": FORMAT,
        "version": VERSION,
        "rows": sum(s.rows for s in shards),
        "columns": columns,
        "shards": [s.to_json() for s in shards],
    }
    remote.write(INDEX_NAME, json.dumps(index, indent=1).encode())
    return index


def write_shards(
    rows: Iterable[dict[str, Any]],
    url: str,
    *,
    shard_bytes: int = 8 << 20,
    row_group_bytes: int | None = None,
    schema: Any = None,
    compression: str = "snappy",
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write rows as Parquet shards to ``url``, then the index.

    A row group is what a reader decodes at once, a shard what it downloads at once. Each shard
    is written to a local temporary file, hashed and uploaded; the index is written last.

    Args:
        rows: The rows, as dicts of column values.
        url: Where the dataset goes: a local directory or an fsspec URL (``s3://...``).
        shard_bytes: The size of a shard, about, in Arrow's in-memory bytes.
        row_group_bytes: The size of a row group, about (default: an eighth of a shard).
        schema: A ``pyarrow.Schema``; inferred from the first rows when left out.
        compression: Parquet's compression codec.
        storage_options: For fsspec, e.g. an S3 ``endpoint_url``, ``key`` and ``secret``.

    Returns:
        The index, as written to ``url``.

    Raises:
        ValueError: the sizes are not ``0 < row_group_bytes <= shard_bytes``, or there are no
            rows.
        TypeError: a row is not a dict.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if row_group_bytes is None:
        row_group_bytes = max(1, shard_bytes // 8)
    if shard_bytes < row_group_bytes or row_group_bytes <= 0:
        raise ValueError(
            f"need 0 < row_group_bytes <= shard_bytes, got row_group_bytes={row_group_bytes}, "
            f"shard_bytes={shard_bytes}"
        )
    remote = Remote(url, storage_options)
    remote.makedirs()
    shards: list[Shard] = []
    pending: list[dict[str, Any]] = []
    state: dict[str, Any] = {"writer": None, "groups": [], "bytes": 0, "schema": schema}

    with tempfile.TemporaryDirectory(prefix="unbroken-shards-") as scratch:
        local = os.path.join(scratch, "shard.parquet")

        def finish_shard() -> None:
            if state["writer"] is None:
                return
            state["writer"].close()
            name = f"shard-{len(shards):05d}.parquet"
            checksum = checksum_of(local, "sha256")
            remote.upload(local, name)
            groups = state["groups"]
            shards.append(Shard(name, sum(groups), groups, os.path.getsize(local), checksum))
            state.update(writer=None, groups=[], bytes=0)

        def write_group(group: list[dict[str, Any]]) -> None:
            table = pa.Table.from_pylist(group, schema=state["schema"])
            if state["schema"] is None:
                state["schema"] = table.schema
            if state["writer"] is None:
                state["writer"] = pq.ParquetWriter(local, table.schema, compression=compression)
            state["writer"].write_table(table, row_group_size=len(group))
            state["groups"].append(len(group))
            state["bytes"] += table.nbytes
            if state["bytes"] >= shard_bytes:
                finish_shard()

        # Rows are gathered until they fill a row group by their estimated size (the mean size
        # of the rows seen so far), so one odd row does not split a group.
        seen_rows, seen_bytes = 0, 0
        for row in rows:
            if not isinstance(row, dict):
                raise TypeError(f"write_shards takes rows as dicts of columns, got {type(row)}")
            pending.append(row)
            if len(pending) in (1, 16) or len(pending) % 256 == 0:
                sample = pa.Table.from_pylist(pending[-16:], schema=state["schema"])
                seen_rows, seen_bytes = seen_rows + sample.num_rows, seen_bytes + sample.nbytes
            if len(pending) * seen_bytes / max(seen_rows, 1) >= row_group_bytes:
                write_group(pending)
                pending = []
        if pending:
            write_group(pending)
        finish_shard()
    if not shards:
        raise ValueError("write_shards got no rows: an empty dataset has nothing to index")
    return _write_index(remote, shards, list(state["schema"].names))


def index_parquet(
    url: str, *, checksums: bool = False, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Index existing Parquet files below ``url`` without rewriting them.

    For instance a Hugging Face dataset exported to Parquet. Only each file's footer is read
    (two small range requests per file): rows, row groups and a checksum of the footer. All
    files must have the same schema.

    Args:
        url: The directory of the files: local or an fsspec URL (``s3://...``).
        checksums: Read every file through to record a sha256 of all of it, so a flipped
            byte anywhere is caught when it is downloaded.
        storage_options: For fsspec, e.g. an S3 ``endpoint_url``, ``key`` and ``secret``.

    Returns:
        The index, as written to ``url``.

    Raises:
        FileNotFoundError: there is no ``.parquet`` file below ``url``.
        CorruptShard: a file is not a Parquet file.
        ValueError: a file has another schema than the first.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    remote = Remote(url, storage_options)
    files = remote.list(".parquet")
    if not files:
        raise FileNotFoundError(f"no .parquet files below {remote.url}")
    shards, schema, first = [], None, ""
    for name, size in files:
        footer = _remote_footer(remote, name, size)
        try:
            meta = pq.read_metadata(pa.BufferReader(b"PAR1" + footer))
        except (OSError, ValueError) as error:
            raise CorruptShard(f"{remote.where(name)} is not a Parquet file: {error}") from None
        file_schema = meta.schema.to_arrow_schema()
        if schema is None:
            schema, first = file_schema, name
        elif not file_schema.equals(schema):
            raise ValueError(
                f"{remote.where(name)} has another schema than {remote.where(first)}: "
                f"{file_schema} != {schema}; index files of one schema together"
            )
        # Empty row groups stay: the reader addresses row groups by their number in the file.
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        if checksums:
            checksum = _remote_sha256(remote, name)
        else:
            checksum = "footer-sha256:" + hashlib.sha256(footer).hexdigest()
        shards.append(Shard(name, sum(groups), groups, size, checksum))
    assert schema is not None
    return _write_index(remote, shards, list(schema.names))


def _remote_footer(remote: Remote, name: str, size: int) -> bytes:
    footer = _footer(lambda count: remote.read(name, start=-count), size)
    if footer is None:
        raise CorruptShard(f"{remote.where(name)} is not a Parquet file (no footer)")
    return footer


def _remote_sha256(remote: Remote, name: str) -> str:
    def stream() -> str:  # from the start on every attempt
        digest = hashlib.sha256()
        with remote.fs.open(remote.path(name), "rb") as file:
            while chunk := file.read(_CHUNK * 8):
                digest.update(chunk)
        return digest.hexdigest()

    return "sha256:" + remote.retrying("read", name, stream)
