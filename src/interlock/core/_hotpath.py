"""The one place that chooses the hot path: compiled ``_hot`` or its pure twin ``_hot_py``.

Every other module imports hot-path names from here. ``INTERLOCK_NO_EXTENSIONS=1``
forces the pure-Python twin; so does a non-CPython interpreter.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

NO_EXTENSIONS = bool(os.environ.get("INTERLOCK_NO_EXTENSIONS")) or (
    sys.implementation.name != "cpython"
)

if TYPE_CHECKING or NO_EXTENSIONS:
    from ._hot_py import (
        FRAMES_CORRUPT,
        FRAMES_OK,
        FRAMES_TORN,
        HEADER_SIZE,
        ILLEGAL_TRANSITION,
        JSON_BAD_ESCAPE,
        JSON_BAD_NUMBER,
        JSON_BAD_UTF8,
        JSON_CONTROL_CHARACTER,
        JSON_DUPLICATE_KEY,
        JSON_EMPTY,
        JSON_EXPECTED_COLON,
        JSON_EXPECTED_COMMA,
        JSON_EXPECTED_KEY,
        JSON_EXPECTED_VALUE,
        JSON_LONE_SURROGATE,
        JSON_TRAILING_COMMA,
        JSON_TRAILING_TEXT,
        JSON_TRUNCATED,
        MAX_IDS,
        OK,
        TOOL_NOT_ALLOWED,
        UNKNOWN_STATE,
        UNKNOWN_TOOL,
        Tables,
        common_affixes,
        compact_failures,
        frame_event,
        frame_events,
        hash64,
        proposal_hash,
        scan_json,
        unframe,
    )

    IMPLEMENTATION = "python"
else:
    try:
        from ._hot import (
            FRAMES_CORRUPT,
            FRAMES_OK,
            FRAMES_TORN,
            HEADER_SIZE,
            ILLEGAL_TRANSITION,
            JSON_BAD_ESCAPE,
            JSON_BAD_NUMBER,
            JSON_BAD_UTF8,
            JSON_CONTROL_CHARACTER,
            JSON_DUPLICATE_KEY,
            JSON_EMPTY,
            JSON_EXPECTED_COLON,
            JSON_EXPECTED_COMMA,
            JSON_EXPECTED_KEY,
            JSON_EXPECTED_VALUE,
            JSON_LONE_SURROGATE,
            JSON_TRAILING_COMMA,
            JSON_TRAILING_TEXT,
            JSON_TRUNCATED,
            MAX_IDS,
            OK,
            TOOL_NOT_ALLOWED,
            UNKNOWN_STATE,
            UNKNOWN_TOOL,
            Tables,
            common_affixes,
            compact_failures,
            frame_event,
            frame_events,
            hash64,
            proposal_hash,
            scan_json,
            unframe,
        )

        IMPLEMENTATION = "compiled"
    except ImportError:  # pragma: no cover - only a broken install gets here
        from ._hot_py import (
            FRAMES_CORRUPT,
            FRAMES_OK,
            FRAMES_TORN,
            HEADER_SIZE,
            ILLEGAL_TRANSITION,
            JSON_BAD_ESCAPE,
            JSON_BAD_NUMBER,
            JSON_BAD_UTF8,
            JSON_CONTROL_CHARACTER,
            JSON_DUPLICATE_KEY,
            JSON_EMPTY,
            JSON_EXPECTED_COLON,
            JSON_EXPECTED_COMMA,
            JSON_EXPECTED_KEY,
            JSON_EXPECTED_VALUE,
            JSON_LONE_SURROGATE,
            JSON_TRAILING_COMMA,
            JSON_TRAILING_TEXT,
            JSON_TRUNCATED,
            MAX_IDS,
            OK,
            TOOL_NOT_ALLOWED,
            UNKNOWN_STATE,
            UNKNOWN_TOOL,
            Tables,
            common_affixes,
            compact_failures,
            frame_event,
            frame_events,
            hash64,
            proposal_hash,
            scan_json,
            unframe,
        )

        IMPLEMENTATION = "python"

__all__ = [
    "FRAMES_CORRUPT",
    "FRAMES_OK",
    "FRAMES_TORN",
    "HEADER_SIZE",
    "ILLEGAL_TRANSITION",
    "IMPLEMENTATION",
    "JSON_BAD_ESCAPE",
    "JSON_BAD_NUMBER",
    "JSON_BAD_UTF8",
    "JSON_CONTROL_CHARACTER",
    "JSON_DUPLICATE_KEY",
    "JSON_EMPTY",
    "JSON_EXPECTED_COLON",
    "JSON_EXPECTED_COMMA",
    "JSON_EXPECTED_KEY",
    "JSON_EXPECTED_VALUE",
    "JSON_LONE_SURROGATE",
    "JSON_TRAILING_COMMA",
    "JSON_TRAILING_TEXT",
    "JSON_TRUNCATED",
    "MAX_IDS",
    "OK",
    "TOOL_NOT_ALLOWED",
    "UNKNOWN_STATE",
    "UNKNOWN_TOOL",
    "Tables",
    "common_affixes",
    "compact_failures",
    "frame_event",
    "frame_events",
    "hash64",
    "proposal_hash",
    "scan_json",
    "unframe",
]
