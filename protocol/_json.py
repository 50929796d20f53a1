"""Reading and writing JSON objects field by field, shared by every codec in this package.

Decoding is strict about types and lenient about unknown fields (so a newer client still gets
through), and every error names the offending field by its full path, e.g.
``message.parts[1].text``. JSON ``null`` counts as absent, as in ProtoJSON. In A2A 1.0, whose JSON
is a2a.proto's ProtoJSON, a field is also read under its proto name (``message_id`` for
``messageId``), as ProtoJSON parsers do.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

import attrs

from protocol.errors import MISSING, InvalidParams, clipped

JsonObject = dict[str, Any]


def compact(pairs: Iterable[tuple[str, object]]) -> JsonObject:
    """An object of ``pairs`` without the ones whose value is None or an empty collection."""
    return {key: value for key, value in pairs if value is not None and value not in ((), [], {})}


def str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    """attrs converter: any iterable of strings, stored as a tuple."""
    if isinstance(value, str):
        raise TypeError(f"expected a list of strings, got the single string {value!r}; wrap it in a list")
    return tuple(value)


def format_timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC with a ``Z``, and 0, 3 or 6 fraction digits, as ProtoJSON prints it."""
    utc = moment.astimezone(timezone.utc).replace(tzinfo=None)
    if not utc.microsecond:
        spec = "seconds"
    elif utc.microsecond % 1000 == 0:
        spec = "milliseconds"
    else:
        spec = "microseconds"
    return utc.isoformat(timespec=spec) + "Z"


def encode_base64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


@functools.cache
def proto_name(json_name: str) -> str:
    """The proto field name behind a lowerCamelCase JSON name: ``messageId`` -> ``message_id``."""
    return re.sub("[A-Z]", lambda upper: "_" + upper.group().lower(), json_name)


@attrs.frozen
class JsonReader:
    """The fields of one JSON object, read with the object's path at hand for errors.

    ``proto_names``: also read each field under its proto name (ProtoJSON, so A2A 1.0)."""

    obj: Mapping[str, object]
    path: str
    proto_names: bool = False

    @classmethod
    def of(cls, value: object, path: str, *, proto_names: bool = False) -> JsonReader:
        if not isinstance(value, dict):
            raise InvalidParams(path or "params", "an object", got=value)
        return cls(value, path, proto_names)

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def value(self, key: str) -> object:
        """The raw value of ``key``, or MISSING when it is absent or null."""
        found = self.obj.get(key)
        if self.proto_names and (alias := proto_name(key)) != key and (other := self.obj.get(alias)) is not None:
            if found is None:
                return other
            if other != found:
                raise InvalidParams(
                    self.at(key), problem=f"is given twice, as {key!r} and as {alias!r} (its proto name), with two values; send one"
                )
        return MISSING if found is None else found

    def sent(self, key: str) -> object:
        """What the client sent under ``key``, for an error to describe: as ``value``, but None
        for a field sent as null, which ``value`` takes for absent (MISSING)."""
        found = self.value(key)
        if found is MISSING and (key in self.obj or (self.proto_names and proto_name(key) in self.obj)):
            return None
        return found

    def has(self, key: str) -> bool:
        return self.value(key) is not MISSING

    def string(self, key: str) -> str:
        found = self.value(key)
        if not isinstance(found, str) or not found:
            raise InvalidParams(self.at(key), "a non-empty string", got=self.sent(key))
        return found

    def opt_string(self, key: str) -> str | None:
        """A string field; an empty string means unset, as for any proto3 string."""
        found = self.value(key)
        if found is MISSING or found == "":
            return None
        if not isinstance(found, str):
            raise InvalidParams(self.at(key), "a string", got=found)
        return found

    def text(self, key: str) -> str:
        """A required string that may be empty (the ``text`` of a part)."""
        found = self.value(key)
        if not isinstance(found, str):
            raise InvalidParams(self.at(key), "a string", got=self.sent(key))
        return found

    def opt_bool(self, key: str) -> bool | None:
        found = self.value(key)
        if found is MISSING:
            return None
        if not isinstance(found, bool):
            raise InvalidParams(self.at(key), "true or false", got=found)
        return found

    def flag(self, key: str) -> bool:
        return self.opt_bool(key) or False

    def opt_int(self, key: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
        """An integer; ProtoJSON also allows its decimal string form ("5")."""
        found = self.value(key)
        if found is MISSING:
            return None
        number = _as_int(found)
        low_ok = number is not None and (minimum is None or number >= minimum)
        if number is None or not low_ok or (maximum is not None and number > maximum):
            raise InvalidParams(self.at(key), _int_expectation(minimum, maximum), got=found)
        if abs(number) > INT32_MAX:  # every integer A2A has is an int32
            raise InvalidParams(self.at(key), problem=f"is {clipped(str(number))}, more than an int32 holds (at most {INT32_MAX})")
        return number

    def opt_object(self, key: str) -> JsonObject | None:
        """A free-form JSON object, such as ``metadata``."""
        found = self.value(key)
        if found is MISSING:
            return None
        if not isinstance(found, dict):
            raise InvalidParams(self.at(key), "an object", got=found)
        return found

    def child(self, key: str) -> JsonReader:
        return JsonReader.of(self.sent(key), self.at(key), proto_names=self.proto_names)

    def opt_child(self, key: str) -> JsonReader | None:
        return self.child(key) if self.has(key) else None

    def items(self, key: str, *, required: bool = False) -> list[tuple[str, object]]:
        """The elements of an array field with their paths; a required array has at least one."""
        found = self.value(key)
        if found is MISSING and not required:
            return []
        if not isinstance(found, list) or (required and not found):
            expected = "a non-empty array" if required else "an array"
            raise InvalidParams(self.at(key), expected, got=self.sent(key))
        return [(f"{self.at(key)}[{index}]", item) for index, item in enumerate(found)]

    def strings(self, key: str) -> tuple[str, ...]:
        result = []
        for path, item in self.items(key):
            if not isinstance(item, str):
                raise InvalidParams(path, "a string", got=item)
            result.append(item)
        return tuple(result)

    def literal(self, key: str, expected: str) -> None:
        """Check a discriminator such as 0.3's ``kind``: absent is fine, anything else must match."""
        found = self.value(key)
        if found is not MISSING and found != expected:
            raise InvalidParams(self.at(key), repr(expected), got=found)

    def opt_timestamp(self, key: str) -> datetime | None:
        found = self.value(key)
        if found is MISSING:
            return None
        moment = _as_timestamp(found)
        if moment is None:
            raise InvalidParams(self.at(key), "an RFC 3339 timestamp with a time zone, from year 1 to 9999 in UTC", got=found)
        return moment

    def base64(self, key: str) -> bytes:
        found = self.value(key)
        if isinstance(found, str):
            try:
                standard = found.replace("-", "+").replace("_", "/")
                return base64.b64decode(standard + "=" * (-len(standard) % 4), validate=True)
            except binascii.Error:
                pass
        raise InvalidParams(self.at(key), "a base64 string", got=self.sent(key))


INT32_MAX = 2**31 - 1
_DECIMAL = re.compile(r"-?[0-9]{1,20}")  # int64 and uint64 need at most 20 digits
_EXPONENT = re.compile(r"-?[0-9]{1,20}(?:\.[0-9]{1,20})?[eE][+-]?[0-9]{1,3}")


def _as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():  # 3.0 or 1e2, as ProtoJSON reads them
        return int(value)
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        return int(value)
    if isinstance(value, str) and _EXPONENT.fullmatch(value):  # "1e2": ProtoJSON takes it quoted too
        return _as_int(float(value))
    return None


def _int_expectation(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an integer from {minimum} to {maximum}"
    if minimum == 0:
        return "a non-negative integer"
    if minimum is not None:
        return f"an integer of at least {minimum}"
    return "an integer"


def _as_timestamp(value: object) -> datetime | None:
    if not isinstance(value, str) or "T" not in value.upper():
        return None
    if value.endswith("z"):  # RFC 3339 allows a lower-case Z; fromisoformat does not
        value = value[:-1] + "Z"
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    try:
        return moment.astimezone(timezone.utc)
    except OverflowError:  # its offset takes it past year 1 or 9999 in UTC
        return None
