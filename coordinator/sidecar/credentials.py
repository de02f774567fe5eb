"""Who may say Hello as what (issue 17, least privilege): `kvledger serve --credentials FILE`.

Each credential is a token (sent in Hello; TCP or the Unix socket) or a Unix uid (the socket's
peer, read from the kernel with SO_PEERCRED: it cannot be forged), bound to the roles it may take
and the engines it may speak for: a list of engine ids, or a tenant (every engine declared in one
of that tenant's namespaces). A worker's credential cannot act as its engine, an engine's cannot
be an operator, and neither can speak for another tenant's engine.

    [[credentials]]
    name = "pod-a"                     # for the logs (a token is never logged)
    token = "…"                        # openssl rand -hex 32
    roles = ["engine", "worker"]
    engines = ["pod-a"]

    [[credentials]]
    name = "ops"
    uid = 0                            # root on this node, through the Unix socket
    roles = ["operator", "observer"]

    [[credentials]]
    name = "tenant-b's workers"
    uid = 1001
    roles = ["worker"]
    tenant = "tenant-b"

Without the file the sidecar trusts as it always did: the shared --token (TCP) and the socket's
owner (the socket is created 0600) may take any role for any engine. Pure: no I/O but reading the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from coordinator.tokens import TokenFileError, TokenMatcher, check_token, read_file, warn_if_readable

Role = Literal["engine", "worker", "observer", "operator"]
ANY_ENGINE = "*"
OPTION = "--credentials"


class Credential(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    roles: Annotated[list[Role], Meta(min_length=1)]
    token: str = ""
    uid: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None
    engines: list[str] = []
    """Engine ids this credential speaks for; "*": every engine."""
    tenant: str = ""
    """Or: every engine declared in a namespace of this tenant."""
    name: str = ""

    @property
    def who(self) -> str:
        """How a message names the credential (never by its token)."""
        if self.name:
            return f"credential {self.name!r}"
        return f"the credential of uid {self.uid}" if self.uid is not None else "this token's credential"


class _File(msgspec.Struct, forbid_unknown_fields=True):
    credentials: list[Credential]


ALL = Credential(roles=["engine", "worker", "observer", "operator"], engines=[ANY_ENGINE], name="shared")
"""What the shared --token, or the socket's owner, may do when no credentials file is given."""


class Credentials:
    def __init__(self, credentials: Sequence[Credential]) -> None:
        self._tokens = TokenMatcher((c.token, c) for c in credentials if c.token)
        self._uids = {c.uid: c for c in credentials if c.uid is not None}
        self.has_tokens = len(self._tokens) > 0

    @property
    def uids(self) -> frozenset[int]:
        return frozenset(self._uids)

    def identify(self, token: str, peer_uid: int | None) -> Credential | None:
        """The credential a Hello presents: its token's, or (no token, on the Unix socket) its
        peer uid's. A token that matches nothing is refused, whatever the uid."""
        if token:
            return self._tokens.match(token)
        return self._uids.get(peer_uid) if peer_uid is not None else None


def load_credentials(path: Path) -> Credentials:
    raw, mode = read_file(path, OPTION)
    try:
        parsed = msgspec.convert(raw, _File)
    except msgspec.ValidationError as error:
        raise TokenFileError(
            f"{OPTION} {path}: {error} (a [[credentials]] table each: token or uid, roles, engines or tenant)"
        ) from None
    if not parsed.credentials:
        raise TokenFileError(f"{OPTION} {path} names no credential")
    uids: set[int] = set()
    for position, credential in enumerate(parsed.credentials, 1):
        where = f"{OPTION} {path}: credential {position}"
        if bool(credential.token) == (credential.uid is not None):
            raise TokenFileError(f"{where} needs exactly one of token and uid")
        if credential.token:
            check_token(credential.token, path=path, option=OPTION, position=position)
        elif credential.uid in uids:
            raise TokenFileError(f"{where}: uid {credential.uid} has a credential already (one per uid)")
        else:
            assert credential.uid is not None
            uids.add(credential.uid)
        if {"engine", "worker"} & set(credential.roles) and not (credential.engines or credential.tenant):
            raise TokenFileError(f'{where} may be an engine or a worker: name its engines (or "*") or its tenant')
    warn_if_readable(path, mode, OPTION)
    return Credentials(parsed.credentials)


def permits(credential: Credential, role: str, engine_id: str, tenants: Sequence[str]) -> str | None:
    """Why `credential` may not say Hello as `role` for `engine_id`, or None. `tenants`: the
    tenant of the engine as it is known and, for a declaration, the tenant it declares (both must
    be the credential's, or an engine id of another tenant could be taken over by declaring it)."""
    if role not in credential.roles:
        return f"{credential.who} may be {' or '.join(credential.roles)}, not {role}"
    if role not in ("engine", "worker"):
        return None
    if ANY_ENGINE in credential.engines or engine_id in credential.engines:
        return None
    if credential.tenant:
        if not tenants:
            return (
                f"engine {engine_id!r} is not declared yet, and {credential.who} speaks only for engines "
                f"of tenant {credential.tenant!r}: connect once the engine is declared"
            )
        others = sorted({tenant for tenant in tenants if tenant != credential.tenant})
        if not others:
            return None
    return f"{credential.who} does not speak for engine {engine_id!r}"
