"""The S3 requests a benchmark's process sends, counted by operation as the client sends them.

``RequestCounter`` wraps aiobotocore's ``AioEndpoint._send_request`` (the client every fsspec
``s3://`` path goes through) while it is open; ``requests_text`` writes a count as a table cell.
Costs a list append a request. Imports aiobotocore when a counter is made.
"""

from __future__ import annotations

import time


class RequestCounter:
    """Counts the S3 requests this process sends, by operation (``PutObject``, ``UploadPart``,
    ``HeadObject``, ``ListObjectsV2``, ...), by wrapping aiobotocore's ``_send_request`` (retries
    of one request count once). Each is stamped with the time it was sent, so that a background
    save's requests can be told from those made before ``save`` returned."""

    def __init__(self) -> None:
        from aiobotocore.endpoint import AioEndpoint

        self.sent: list[tuple[float, str]] = []
        self._cls = AioEndpoint
        self._original = AioEndpoint._send_request
        sent, original = self.sent, self._original

        async def counting(endpoint, request_dict, operation_model):
            sent.append((time.perf_counter(), operation_model.name))
            return await original(endpoint, request_dict, operation_model)

        AioEndpoint._send_request = counting

    def take(self, before: float = float("inf")) -> dict[str, int]:
        """The requests sent before ``before`` (all by default), by operation; forgotten."""
        counts: dict[str, int] = {}
        for _, name in [e for e in self.sent if e[0] < before]:
            counts[name] = counts.get(name, 0) + 1
        self.sent[:] = [e for e in self.sent if e[0] >= before]
        return dict(sorted(counts.items()))

    def close(self) -> None:
        self._cls._send_request = self._original


def requests_text(counts: dict[str, int]) -> str:
    """``total: Operation n, ...`` (``0`` for none)."""
    total = sum(counts.values())
    return f"{total}: " + ", ".join(f"{k} {v}" for k, v in counts.items()) if counts else "0"
