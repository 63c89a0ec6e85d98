"""Sharded datasets in object storage, streamed with exact, O(1), elastic resume.

- ``write_shards(rows, url)``: Parquet shards plus a JSON index, to any fsspec URL.
- ``index_parquet(url)``: an index for existing Parquet files, from their footers only.
- ``StreamingDataset(url, cache_dir=...)``: a map-style dataset over the index, for
  ``unbroken.DataLoader`` (shuffle, exact prefetch, a crash-safe shared cache).

Modules: ``dataset`` (``StreamingDataset``), ``index`` (the index, ``write_shards``,
``index_parquet``), ``remote`` (where a dataset lives), ``order`` (the locality-aware shuffle),
``prefetch`` (the shards the loader reads next), ``cache`` (the machine's shard cache).
"""

from .cache import ShardCache
from .dataset import StreamingDataset, default_cache_dir
from .index import index_parquet, write_shards

__all__ = ["ShardCache", "StreamingDataset", "default_cache_dir", "index_parquet", "write_shards"]
