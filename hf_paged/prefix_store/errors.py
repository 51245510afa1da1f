"""Errors of the prefix store. Each message says what was wrong and what to do."""

from __future__ import annotations


class StoreUnavailable(RuntimeError):
    """A store cannot be opened (unreachable Redis, a folder that cannot be created, a missing client)."""


class UnsafeStoreDirectory(StoreUnavailable, PermissionError):
    """A store folder that another user could write: its files would become a model's keys and values."""


class BadEntry(Exception):
    """A stored entry that must not be used (truncated, corrupt, foreign): the store skips and removes it."""
