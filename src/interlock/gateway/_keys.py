"""The gateway's bearer keys: who a request is, what it may do, and where the server may listen.

A key is a random secret sent as ``Authorization: Bearer <key>``. The server keeps only its
sha256 digest: for a random key of 128 bits or more a plain hash is enough (nobody can search
that space, so a slow password hash would buy nothing and cost every request). Make a key with
``python -c "import secrets; print(secrets.token_urlsafe(32))"`` and its digest with
``printf %s "$KEY" | sha256sum`` (or ``python -c "import hashlib,sys;
print(hashlib.sha256(sys.argv[1].encode()).hexdigest())" "$KEY"``).

Two ways to configure keys, which may be combined:

- ``INTERLOCK_API_KEY``: one key with every role on every machine (principal ``"default"``).
- ``INTERLOCK_API_KEYS_FILE``: a TOML file of named keys, each with its roles and machines::

      [keys.billing-agent]
      sha256 = "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"
      roles = ["agent"]
      machines = ["refund"]        # optional: omit it for every machine

      [keys.oncall]
      sha256 = "..."
      roles = ["operator"]

Roles: ``agent`` starts runs, proposes and reports results; ``operator`` works the escalation
queue; ``reader`` lists and reads runs, their events and streams, and the metrics. ``agent`` and
``operator`` both imply ``reader``: an external agent must read the run it drives, and an
operator must see the run before resuming it. Nothing implies ``agent`` or ``operator``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..core._exceptions import InterlockError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = [
    "ANONYMOUS",
    "ROLES",
    "KeyRing",
    "Principal",
    "Unauthorized",
    "check_bind",
    "hash_key",
    "is_loopback",
]

log = logging.getLogger("interlock.gateway")

#: Every role a key may hold.
ROLES = frozenset({"agent", "operator", "reader"})

#: Roles that also grant ``reader``.
_IMPLY_READER = frozenset({"agent", "operator"})

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_ENTRY_FIELDS = ("sha256", "roles", "machines")
_HOW_TO_HASH = 'printf %s "$KEY" | sha256sum'


class Unauthorized(InterlockError):
    """A request carried no key, a malformed ``Authorization`` header, or a key not configured.

    The message says what to send instead; it never contains the key that was sent.
    """


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is: the name of its key, the roles it holds and the machines it may touch.

    Attributes:
      name: the key's name in the keys file (``"default"`` for ``INTERLOCK_API_KEY``,
        ``"anonymous"`` when the server has no keys). Rate limits and run quotas count per name.
      roles: the roles as configured, a subset of :data:`ROLES`.
      machines: the machine names this key may touch, or ``None`` for every machine.
    """

    name: str
    roles: frozenset[str]
    machines: frozenset[str] | None = None
    _granted: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a principal needs a non-empty name, not {self.name!r}")
        if isinstance(self.roles, str):
            raise ValueError(
                f"principal {self.name!r}: roles must be a set of role names, e.g. "
                f"frozenset({{{self.roles!r}}}), not a string"
            )
        roles = frozenset(self.roles)
        unknown = sorted(r for r in roles if r not in ROLES)
        if unknown or not roles:
            raise ValueError(
                f"principal {self.name!r}: roles must be a non-empty subset of "
                f"{', '.join(sorted(ROLES))}; got {sorted(map(str, roles))}"
            )
        object.__setattr__(self, "roles", roles)
        if self.machines is not None:
            machines = frozenset(self.machines)
            if (
                isinstance(self.machines, str)
                or not machines
                or not all(isinstance(m, str) and m for m in machines)
            ):
                raise ValueError(
                    f"principal {self.name!r}: machines must be None (every machine) or a "
                    f"non-empty set of machine names"
                )
            object.__setattr__(self, "machines", machines)
        granted = roles | {"reader"} if roles & _IMPLY_READER else roles
        object.__setattr__(self, "_granted", granted)

    def allows(self, role: str, machine: str | None = None) -> bool:
        """Whether this principal holds ``role`` (directly or implied) and may touch ``machine``.

        Args:
          role: ``"agent"``, ``"operator"`` or ``"reader"``.
          machine: the machine the request touches; ``None`` checks the role only (a listing
            must then filter by :attr:`machines` itself).
        """
        if role not in self._granted:
            return False
        return machine is None or self.machines is None or machine in self.machines


#: The principal of every request to a server configured with no key at all.
ANONYMOUS = Principal("anonymous", ROLES)


def hash_key(key: str) -> str:
    """Return the hex sha256 digest of ``key``: the value a keys file stores for it."""
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """The keys a gateway accepts, stored as sha256 digests.

    Build it with :meth:`from_env` or :meth:`from_file`, or directly from ``(digest,
    principal)`` pairs. A key ring with no entry is *open*: every request is the anonymous
    principal with every role, and :func:`check_bind` keeps the server on loopback.
    """

    __slots__ = ("_by_digest", "_warned_open", "principals")

    def __init__(self, entries: Iterable[tuple[bytes, Principal]] = ()) -> None:
        """Args:
        entries: pairs of a key's raw 32-byte sha256 digest and its principal.

        Raises:
          ValueError: if a digest is not 32 bytes, or a digest or a name appears twice.
        """
        by_digest: dict[bytes, tuple[bytes, Principal]] = {}
        names: set[str] = set()
        for digest, principal in entries:
            if not isinstance(digest, bytes) or len(digest) != 32:
                raise ValueError(
                    f"key {principal.name!r}: a digest must be the 32 raw bytes of a sha256"
                )
            if digest in by_digest:
                raise ValueError(
                    f"keys {by_digest[digest][1].name!r} and {principal.name!r} have the same "
                    f"sha256; give each its own random key"
                )
            if principal.name in names:
                raise ValueError(f"two keys are named {principal.name!r}; names must be unique")
            by_digest[digest] = (digest, principal)
            names.add(principal.name)
        self._by_digest = by_digest
        self._warned_open = False  # check_bind said once that it serves open
        #: The configured principals, by name.
        self.principals: Mapping[str, Principal] = {p.name: p for _, p in by_digest.values()}

    @property
    def open(self) -> bool:
        """True when no key is configured (the server must then stay on loopback)."""
        return not self._by_digest

    def __len__(self) -> int:
        return len(self._by_digest)

    def __repr__(self) -> str:
        return f"KeyRing({sorted(self.principals)!r})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KeyRing:
        """The key ring configured by ``INTERLOCK_API_KEY`` and/or ``INTERLOCK_API_KEYS_FILE``.

        Args:
          environ: the environment to read; ``os.environ`` by default.

        Raises:
          ValueError: if a variable is set but empty, the key holds whitespace, or the keys
            file has a mistake (the message names the file, the entry and the fix).
        """
        env = os.environ if environ is None else environ
        entries: list[tuple[bytes, Principal]] = []
        key = env.get("INTERLOCK_API_KEY")
        if key is not None:
            if not key:
                raise ValueError(
                    "INTERLOCK_API_KEY is set but empty; set it to a random key (python -c "
                    '"import secrets; print(secrets.token_urlsafe(32))") or unset it to serve '
                    "on loopback without keys"
                )
            if not key.isascii() or not key.isprintable() or " " in key:
                raise ValueError(
                    "INTERLOCK_API_KEY must be printable ASCII without spaces (it is sent in an "
                    "HTTP header); generate one with python -c "
                    '"import secrets; print(secrets.token_urlsafe(32))"'
                )
            entries.append((hashlib.sha256(key.encode()).digest(), Principal("default", ROLES)))
        path = env.get("INTERLOCK_API_KEYS_FILE")
        if path is not None:
            if not path:
                raise ValueError(
                    "INTERLOCK_API_KEYS_FILE is set but empty; set it to the path of a keys file "
                    "or unset it"
                )
            entries.extend(_read_keys_file(Path(path)))
        return cls(entries)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KeyRing:
        """The key ring of a TOML keys file (the format is in this module's docstring).

        Raises:
          ValueError: for every mistake in the file, naming the file, the entry and the fix.
        """
        return cls(_read_keys_file(Path(path)))

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of a request, from its ``Authorization`` header (``None`` if absent).

        An open key ring answers the anonymous principal whatever the header says.

        Raises:
          Unauthorized: no header, not a ``Bearer`` credential, or a key not configured.
        """
        if not self._by_digest:
            return ANONYMOUS
        if authorization is None:
            raise Unauthorized(
                "this server needs an API key; send the header 'Authorization: Bearer <key>'"
            )
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise Unauthorized(
                "the Authorization header must use the Bearer scheme: 'Authorization: Bearer <key>'"
            )
        token = token.strip()
        if not token or not token.isascii():
            raise Unauthorized(
                "the Bearer credential is empty or not ASCII; send 'Authorization: Bearer <key>'"
            )
        digest = hashlib.sha256(token.encode()).digest()
        # NOTE: only digests are ever compared, never the secret. The dict finds the candidate
        # by the digest's hash (SipHash, randomly keyed per process), so its timing says nothing
        # about how many bytes of a stored digest match; compare_digest confirms the match in
        # constant time. Looking up instead of looping keeps this O(1) in the number of keys.
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found[0], digest):
            raise Unauthorized(
                "the API key is not one this server accepts; check INTERLOCK_API_KEY or the "
                "server's keys file"
            )
        return found[1]


def _read_keys_file(path: Path) -> list[tuple[bytes, Principal]]:
    where = str(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ValueError(
            f"keys file {where}: cannot be read ({exc.strerror or exc}); check the path given "
            f"by INTERLOCK_API_KEYS_FILE"
        ) from None
    try:
        document = tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"keys file {where}: is not UTF-8 text; save it as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"keys file {where}: is not valid TOML: {exc}") from None
    extra = sorted(k for k in document if k != "keys")
    if extra:
        raise ValueError(
            f"keys file {where}: unknown top-level entries {extra}; put every key in a "
            f"[keys.NAME] table"
        )
    tables = document.get("keys")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(
            f"keys file {where}: defines no keys; add a table per key: [keys.NAME] with "
            f'sha256 = "<{_HOW_TO_HASH}>" and roles = ["agent"]'
        )
    entries: list[tuple[bytes, Principal]] = []
    seen: dict[bytes, str] = {}
    for name, entry in tables.items():
        at = f"keys file {where}: [keys.{name}]"
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{at}: a key's name must be 1-64 letters, digits, '_', '.' or '-', starting "
                f"with a letter or digit"
            )
        if not isinstance(entry, dict):
            raise ValueError(f"{at}: must be a table ([keys.{name}]), not a plain value")
        unknown = sorted(k for k in entry if k not in _ENTRY_FIELDS)
        if unknown:
            raise ValueError(
                f"{at}: unknown fields {unknown}; a key has {', '.join(_ENTRY_FIELDS)}"
            )
        digest_hex = entry.get("sha256")
        if digest_hex is None:
            raise ValueError(f'{at}: has no sha256; add sha256 = "<output of {_HOW_TO_HASH}>"')
        # NOTE: never echo this value: a user may have pasted the key itself here.
        if not isinstance(digest_hex, str) or not _HEX64.fullmatch(digest_hex):
            raise ValueError(
                f"{at}: sha256 must be 64 hex characters, the digest of the key (store the "
                f"hash, never the key): {_HOW_TO_HASH}"
            )
        digest = bytes.fromhex(digest_hex)
        if digest in seen:
            raise ValueError(
                f"{at}: has the same sha256 as [keys.{seen[digest]}]; give each its own random key"
            )
        seen[digest] = name
        roles = entry.get("roles")
        if (
            not isinstance(roles, list)
            or not roles
            or not all(isinstance(r, str) and r in ROLES for r in roles)
        ):
            raise ValueError(
                f"{at}: roles must be a non-empty list of {', '.join(sorted(ROLES))}, e.g. "
                f'roles = ["agent"]; got {roles!r}'
            )
        machines = entry.get("machines")
        if machines is not None and (
            not isinstance(machines, list)
            or not machines
            or not all(isinstance(m, str) and m for m in machines)
        ):
            raise ValueError(
                f"{at}: machines must be a non-empty list of machine names, e.g. "
                f'machines = ["refund"]; omit it to allow every machine; got {machines!r}'
            )
        entries.append(
            (
                digest,
                Principal(
                    name, frozenset(roles), None if machines is None else frozenset(machines)
                ),
            )
        )
    return entries


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ``::1``, ``localhost``) or a
    Unix socket (``unix:PATH``), where only this machine can connect."""
    host = host.strip()
    if host.startswith("unix:"):
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_bind(host: str, keyring: KeyRing) -> None:
    """Refuse to serve without keys anywhere but loopback; say so when serving open on loopback.

    Call it before binding. With keys configured any address is allowed. With none, a
    loopback host is allowed and a warning is logged on the ``interlock.gateway`` logger
    (every request then has every role).

    Raises:
      ValueError: if ``host`` is empty, or not loopback while the key ring is open.
    """
    if not isinstance(host, str) or not host.strip():
        raise ValueError("the host to bind is empty; pass e.g. --host 127.0.0.1")
    if not keyring.open:
        return
    if not is_loopback(host):
        raise ValueError(
            f"refusing to serve on {host!r} without an API key: anyone who reaches it could "
            f"drive runs; set INTERLOCK_API_KEY (one key, every role) or INTERLOCK_API_KEYS_FILE "
            f"(a keys file), or bind to 127.0.0.1"
        )
    if getattr(keyring, "_warned_open", False):
        return  # said once per key ring: the gateway and its channel share one
    log.warning(
        "no API key configured: serving on %s (loopback only) and every request has every role; "
        "set INTERLOCK_API_KEY or INTERLOCK_API_KEYS_FILE to require keys",
        host,
    )
    with contextlib.suppress(AttributeError):
        keyring._warned_open = True
