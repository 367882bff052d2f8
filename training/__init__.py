"""The in-training async save hook (``AsyncCheckpointer``) and framework adapters.

Not built yet: see issue #4. Until then, ``converters.dcp.save`` writes a committed,
verifiable DCP checkpoint synchronously.
"""

__all__: list[str] = []
