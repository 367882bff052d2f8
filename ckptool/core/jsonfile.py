"""JSON documents a checkpoint holds (``config.json``, a model config given by the user):
untrusted text, parsed into a JSON object or refused in one line."""

from __future__ import annotations

import json

from ckptool.core.errors import CkptoolError, UnreadableInput


def json_object(raw: bytes | str, where: str, what: str,
                error: type[CkptoolError] = UnreadableInput) -> dict:
    """``raw`` parsed as a JSON object; ``error`` (naming ``what`` at ``where``) when it is not
    JSON, is nested past the parser's depth, or is another JSON value (a list, a number)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        why = "nested too deep" if isinstance(exc, RecursionError) else "not valid JSON"
        raise error(f"{what} is {why}", path=where) from None
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
                float: "a number"}.get(type(value), "null")
        raise error(f"{what} is not a JSON object but {kind}", path=where)
    return value
