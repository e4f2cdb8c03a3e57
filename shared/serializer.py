"""The orjson serializer plugged into RQ: JSON only, so no pickle can ever be loaded."""

from __future__ import annotations

from typing import Any

import orjson

from shared.errors import PayloadError

_PICKLE_PROTOCOL_MARK = 0x80  # every pickle of protocol >= 2 starts with this byte


class OrjsonSerializer:
    """RQ serializer (dumps/loads) that refuses anything that is not JSON, pickles included."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)

    @staticmethod
    def loads(data: bytes | str) -> Any:
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogateescape")
        if data[:1] and data[0] == _PICKLE_PROTOCOL_MARK:
            raise PayloadError("refusing a pickled payload: kevlaya accepts JSON only")
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise PayloadError(f"payload is not valid JSON: {exc}") from exc


# RQ wants the class itself (it records its dotted name); the methods are static.
serializer = OrjsonSerializer
