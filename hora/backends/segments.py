"""The names of hora's shared-memory segments, and their removal after a crash.

The rule lives in :mod:`hora.config` (the launcher removes a dead rank's segments by name
without importing a backend); this module gives it to :mod:`hora.backends.shm`.
Layer: backends.
"""
from ..config import SEGMENT_DIR, SEGMENT_PREFIX, remove_segments_of

__all__ = ["SEGMENT_DIR", "SEGMENT_PREFIX", "remove_segments_of"]
