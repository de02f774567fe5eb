"""Bearer tokens and the files that grant them: the audit API's tokens file (coordinator/audit/api.py)
and the sidecar's credentials file (coordinator/sidecar/credentials.py) are read and matched here.

A file is TOML when its name ends in .toml, JSON when it ends in .json, else JSON if it starts
with "{". No message here quotes a token: neither parser's error quotes the text, and a bad token
is named by its position.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog

log = structlog.get_logger("kvledger.tokens")

MIN_TOKEN_LENGTH = 16
TOKEN_SYNTAX = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750's b64token: what a header can carry

G = TypeVar("G")


class TokenFileError(ValueError):
    """A tokens or credentials file the sidecar refuses to start with. The message never quotes a token."""


def read_file(path: Path, option: str) -> tuple[Any, int]:
    """The file's content, parsed (TOML or JSON), and its mode (for `warn_if_readable`)."""
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as error:
        raise TokenFileError(f"{option} {path}: {error.strerror or error}") from None
    as_toml = path.suffix == ".toml" or (path.suffix != ".json" and not text.lstrip().startswith("{"))
    try:
        raw: Any = tomllib.loads(text) if as_toml else json.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise TokenFileError(f"{option} {path} is not valid TOML: {error}") from None
    except json.JSONDecodeError as error:
        raise TokenFileError(f"{option} {path} is not valid JSON: {error.msg} at line {error.lineno}") from None
    return raw, mode


def warn_if_readable(path: Path, mode: int, option: str) -> None:
    """Once the file was taken: a warning when others than its owner may read it."""
    if mode & 0o077:
        log.warning("tokens_file_readable_by_others", option=option, path=str(path), mode=oct(mode & 0o777))


def check_token(token: str, *, path: Path, option: str, position: int) -> None:
    if len(token) < MIN_TOKEN_LENGTH or not TOKEN_SYNTAX.fullmatch(token):
        raise TokenFileError(
            f"{option} {path}: token {position} must be at least {MIN_TOKEN_LENGTH} characters of "
            "A-Z a-z 0-9 - . _ ~ + / (then any '='), e.g. from `openssl rand -hex 32`"
        )


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenMatcher(Generic[G]):
    """Tokens and what each grants. `match` takes the same time whichever token matches, or
    none: it compares SHA-256 digests (hmac.compare_digest is constant-time only between equal
    lengths, and a digest hides the length) against every token, without stopping at a match."""

    def __init__(self, grants: Iterable[tuple[str, G]]) -> None:
        self._grants = [(_digest(token), grant) for token, grant in grants]

    def __len__(self) -> int:
        return len(self._grants)

    def match(self, presented: str) -> G | None:
        digest = _digest(presented)
        found = None
        for known, grant in self._grants:
            if hmac.compare_digest(digest, known):
                found = grant
        return found
