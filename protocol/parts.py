"""Parts, the pieces of a message or artifact: text, structured data, or a file.

1.0 tells the kinds apart by which content field is set (``text``, ``raw``, ``url``, ``data``);
0.3 by a ``kind`` discriminator, with file content nested under ``file``.
"""

from __future__ import annotations

from typing import Union

import attrs

from protocol._json import JsonObject, JsonReader, compact, encode_base64
from protocol.errors import InvalidParams
from protocol.versions import ProtocolVersion

V1 = ProtocolVersion.V1_0

# The metadata key that marks a 0.3 data part as a wrapped value ({"value": ...}) rather than an
# object, as the a2a-sdk's 0.3 codec (compat/v0_3/conversions.py) writes and reads it.
DATA_PART_COMPAT = "data_part_compat"


@attrs.frozen
class TextPart:
    text: str = attrs.field(validator=attrs.validators.instance_of(str))
    media_type: str | None = None
    """Only 1.0 can carry it; 0.3 has no media type on text."""
    metadata: JsonObject | None = None

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        if version is V1:
            return compact([("text", self.text), ("mediaType", self.media_type), ("metadata", self.metadata)])
        return compact([("kind", "text"), ("text", self.text), ("metadata", self.metadata)])


@attrs.frozen
class DataPart:
    data: object
    """Any JSON value in 1.0; 0.3 only allows an object, see ``to_json``."""
    media_type: str | None = None
    metadata: JsonObject | None = None

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        if version is V1:
            return {"data": self.data, **compact([("mediaType", self.media_type), ("metadata", self.metadata)])}
        if isinstance(self.data, dict):
            return {"kind": "data", "data": self.data, **compact([("metadata", self.metadata)])}
        # 0.3 DataPart.data is an object: any other JSON value goes as the reference's 0.3 codec
        # sends it, under "value" and marked in the metadata, so that 0.3 clients unwrap it.
        return {"kind": "data", "data": {"value": self.data}, "metadata": {**(self.metadata or {}), DATA_PART_COMPAT: True}}


@attrs.frozen
class FilePart:
    """A file, inline (``raw``) or by reference (``url``): exactly one of the two."""

    raw: bytes | None = None
    url: str | None = None
    filename: str | None = None
    media_type: str | None = None
    metadata: JsonObject | None = None

    def __attrs_post_init__(self) -> None:
        if (self.raw is None) == (self.url is None):
            raise ValueError("a FilePart needs exactly one of raw= and url=")

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        raw = None if self.raw is None else encode_base64(self.raw)
        if version is V1:
            fields = [("raw", raw), ("url", self.url), ("filename", self.filename), ("mediaType", self.media_type)]
            return compact([*fields, ("metadata", self.metadata)])
        file = compact([("bytes", raw), ("uri", self.url), ("name", self.filename), ("mimeType", self.media_type)])
        return compact([("kind", "file"), ("file", file), ("metadata", self.metadata)])


Part = Union[TextPart, DataPart, FilePart]

_V1_CONTENT = ("text", "raw", "url", "data")


def part_from_json(obj: object, version: ProtocolVersion, path: str) -> Part:
    """Decode one part; raises InvalidParams naming ``path`` (e.g. ``message.parts[0]``)."""
    reader = JsonReader.of(obj, path, proto_names=not version.is_legacy)
    if version is V1:
        return _part_v1(reader)
    return _part_v03(reader)


def _part_v1(reader: JsonReader) -> Part:
    # data is a google.protobuf.Value, whose ProtoJSON null is a value (NULL_VALUE), not unset.
    present = [key for key in _V1_CONTENT if reader.has(key) or (key == "data" and key in reader.obj)]
    if len(present) != 1:
        null = next((key for key in _V1_CONTENT if key in reader.obj and reader.obj[key] is None), None)
        if not present and null is not None:  # null reads as unset, which left the part empty
            raise InvalidParams(
                reader.at(null), problem="is null; give it a value (a part holds exactly one of 'text', 'raw', 'url', 'data')"
            )
        raise InvalidParams(reader.path, "an object with exactly one of 'text', 'raw', 'url', 'data'", got=reader.obj)
    media_type = reader.opt_string("mediaType")
    metadata = reader.opt_object("metadata")
    if present == ["text"]:
        return TextPart(reader.text("text"), media_type, metadata)
    if present == ["data"]:
        return DataPart(reader.obj["data"], media_type, metadata)
    raw = reader.base64("raw") if present == ["raw"] else None
    url = reader.string("url") if present == ["url"] else None
    return FilePart(raw, url, reader.opt_string("filename"), media_type, metadata)


def _part_v03(reader: JsonReader) -> Part:
    kind = reader.value("kind")
    metadata = reader.opt_object("metadata")
    if kind == "text":
        return TextPart(reader.text("text"), None, metadata)
    if kind == "data":
        data = reader.opt_object("data")
        if data is None:
            raise InvalidParams(reader.at("data"), "an object", got=reader.sent("data"))
        if metadata is None or metadata.get(DATA_PART_COMPAT) is not True:
            return DataPart(data, None, metadata)
        if "value" not in data:
            raise InvalidParams(reader.at("data.value"), problem=f"is missing: the part's metadata says {DATA_PART_COMPAT}")
        rest = {key: value for key, value in metadata.items() if key != DATA_PART_COMPAT}
        return DataPart(data["value"], None, rest or None)
    if kind == "file":
        file = reader.child("file")
        if file.has("bytes") == file.has("uri"):
            raise InvalidParams(file.path, "an object with exactly one of 'bytes', 'uri'", got=file.obj)
        raw = file.base64("bytes") if file.has("bytes") else None
        url = file.string("uri") if file.has("uri") else None
        return FilePart(raw, url, file.opt_string("name"), file.opt_string("mimeType"), metadata)
    raise InvalidParams(reader.at("kind"), "one of 'text', 'file', 'data'", got=kind)
