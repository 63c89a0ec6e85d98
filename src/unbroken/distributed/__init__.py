"""Data parallelism on ``torch.distributed`` (torchrun): rank-aware orders and sharded state.

Empty for now: this is where the distributed pieces go (issue 10), so that ``data``,
``checkpoint`` and ``train`` keep one concern each.
"""

__all__: list[str] = []
