"""Protocol versions and the ``A2A-Version`` header rule (spec 1.0 §3.6).

Negotiation uses Major.Minor only: "1.0" and "1.0.1" both mean 1.0. An absent or empty header
means 0.3, because 0.3 clients never sent one (§3.6.2).
"""

from __future__ import annotations

import enum
import re

from protocol.errors import VersionNotSupported

VERSION_HEADER = "A2A-Version"

_MAJOR_MINOR = re.compile(r"([0-9]{1,9})\.([0-9]{1,9})(?:\.[0-9]+)?")


class ProtocolVersion(enum.Enum):
    """An A2A version Keel speaks. The value is its Major.Minor string."""

    V1_0 = "1.0"
    V0_3 = "0.3"

    @property
    def is_legacy(self) -> bool:
        return self is ProtocolVersion.V0_3

    @property
    def other(self) -> ProtocolVersion:
        return ProtocolVersion.V1_0 if self.is_legacy else ProtocolVersion.V0_3

    @property
    def how_sent(self) -> str:
        """How a client of this version sends its requests, in words that follow "sends them"."""
        return "without an A2A-Version header" if self.is_legacy else f"with the header A2A-Version: {self.value}"


def requested_version(header: str | None) -> str:
    """The Major.Minor a client asked for, or the header text itself when it has no such shape.

    >>> requested_version(None), requested_version("1.0.1"), requested_version(" 2.0 ")
    ('0.3', '1.0', '2.0')
    """
    text = (header or "").strip()
    if not text:
        return ProtocolVersion.V0_3.value
    match = _MAJOR_MINOR.fullmatch(text)
    if match is None:
        return text
    return f"{int(match.group(1))}.{int(match.group(2))}"


def parse_version_header(header: str | None) -> ProtocolVersion:
    """The version a request's ``A2A-Version`` header selects.

    Raises VersionNotSupported when it names a version Keel does not speak.
    """
    requested = requested_version(header)
    for version in ProtocolVersion:
        if version.value == requested:
            return version
    raise VersionNotSupported(requested)
