"""Parsing JSON the trainer did not necessarily write itself (checkpoint manifests, logs,
``summary.json``, ``--config``, data manifests, JSON options), safely.

:func:`loads` caps the text's size before parsing, turns ``RecursionError`` and
``MemoryError`` (a line of 100,000 brackets, 3,000 nested objects) into a ``ValueError`` that
names where the text came from, and refuses values nested deeper than :data:`MAX_DEPTH` (the
trainer's own files nest 4 levels at most; a value nested 900 deep parses but breaks every later
``json.dumps`` or comparison of it).
"""

from __future__ import annotations

import json
from typing import Any

#: Deepest nesting accepted (objects and arrays); the trainer's files nest at most 4 deep.
MAX_DEPTH = 64
#: Longest JSON text parsed (characters); callers reading files cap their size first.
MAX_CHARS = 1 << 28


def depth(value: Any) -> int:
    """How deeply ``value`` nests lists and dicts (iterative: never a RecursionError)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            return level
        stack.extend((child, level + 1) for child in children)
    return deepest


def loads(text: str | bytes, where: str, max_chars: int = MAX_CHARS) -> Any:
    """``json.loads(text)``, or a ``ValueError`` starting with ``where`` (``file`` or
    ``file:line``) for invalid JSON, too long a text, or nesting deeper than :data:`MAX_DEPTH`;
    never a ``RecursionError`` or ``MemoryError``."""
    if len(text) > max_chars:
        raise ValueError(f"{where}: {len(text)} characters of JSON, more than {max_chars}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        at = f"line {err.lineno} column {err.colno}" if err.lineno > 1 else f"column {err.colno}"
        raise ValueError(f"{where}: not valid JSON ({err.msg} at {at})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 ({err.reason} at byte {err.start})") from None
    except RecursionError:
        raise ValueError(
            f"{where}: JSON nested too deeply to parse (more than {MAX_DEPTH} levels)"
        ) from None
    except MemoryError:
        raise ValueError(f"{where}: JSON too large to parse in memory") from None
    if depth(value) > MAX_DEPTH:
        raise ValueError(f"{where}: JSON nested more than {MAX_DEPTH} levels deep")
    return value
