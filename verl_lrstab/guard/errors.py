"""The guard's error: a guarded launch that cannot work as given.

A module of its own so that every module of the guard raises the same error without importing the
decisions of :mod:`.plan`, which itself writes the launch line through :mod:`.overrides`.
"""

from __future__ import annotations


class GuardError(ValueError):
    """A guarded launch that cannot work as given (the message names the key and what to set)."""
