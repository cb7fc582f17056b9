"""Transport security and caller identity for every gRPC hop.

Servers: TLS from a certificate/key pair, mTLS when a client CA is given (optionally limited to
certain certificate names), and bearer tokens from a file of ``identity:token`` lines. The
caller's identity (token identity, else certificate name) is what sessions are bound to.

Clients (the coordinator calling workers): TLS/mTLS channel credentials and a bearer token sent
as ``authorization`` metadata with every call.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import os
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
import structlog

from specdec.serving.errors import PermissionDenied, Unauthenticated

log = structlog.get_logger(__name__)
T = TypeVar("T")

# The authenticated caller of the RPC being handled ("" when authentication is off).
caller_identity: contextvars.ContextVar[str] = contextvars.ContextVar("specdec_caller_identity", default="")

_AUTH_HEADER = "authorization"
_CERT_NAME_KEYS = ("x509_common_name", "x509_subject_alternative_name")
_RECHECK_S = 1.0  # credential files are looked at (stat) at most this often


class FileWatch:
    """Tells when any of some files has changed (another inode, size or modification time: a
    Secret volume's update swaps in new files), looking at most once per ``every_s``."""

    def __init__(self, paths: Sequence[str], every_s: float = _RECHECK_S) -> None:
        self._paths = tuple(paths)
        self._every_s = every_s
        self._next = time.monotonic() + every_s
        self._seen = self._stamp()

    def _stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        stamps: list[tuple[int, int, int] | None] = []
        for path in self._paths:
            try:
                st = os.stat(path)
            except OSError:
                stamps.append(None)
                continue
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(stamps)

    def changed(self) -> bool:
        """True once after each change (each caller's own reload follows)."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self._every_s
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        self._seen = stamp
        return True


class Reloaded(Generic[T]):
    """What ``load`` makes of some files, made again when any of them changes (a Secret volume's
    update, a renewed certificate). ``load`` runs at once (its ValueError stops start-up); later,
    a load that fails (a file that cannot be read or does not parse, a key that does not fit its
    certificate: ValueError) leaves ``value`` as it is. Logs ``<event>_reloaded`` or
    ``<event>_not_reloaded`` with ``fields``, never the value."""

    def __init__(self, paths: Sequence[str], load: Callable[[], T], event: str, what: str, **fields: Any) -> None:
        self._load, self._event, self._what, self._fields = load, event, what, fields
        self.value = load()
        self._watch = FileWatch(paths)

    def renew(self) -> bool:
        """Loads again if the files changed since the last look; True when ``value`` is new."""
        if not self._watch.changed():
            return False
        try:
            self.value = self._load()
        except ValueError as exc:
            log.warning(
                f"{self._event}_not_reloaded", **self._fields, error=str(exc), effect=f"the {self._what} in use stays"
            )
            return False
        log.info(f"{self._event}_reloaded", **self._fields)
        return True

    def current(self) -> T:
        self.renew()
        return self.value


def read_secret_file(path: str, what: str) -> bytes:
    """A credential file's bytes; the error names the file and the setting, never the content."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path!r}: {exc.strerror}") from None
    if not data.strip():
        raise ValueError(f"the {what} file {path!r} is empty")
    return data


def load_tokens(path: str) -> dict[str, str]:
    """Parses a tokens file: one ``identity:token`` per line (``#`` comments and blank lines skipped).

    Returns token -> identity. Identities name callers in logs and own their sessions.
    """
    tokens: dict[str, str] = {}
    for number, raw in enumerate(read_secret_file(path, "auth tokens").decode().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        identity, sep, token = line.partition(":")
        identity, token = identity.strip(), token.strip()
        if not sep or not identity or len(token) < 16:
            raise ValueError(f"{path} line {number}: expected 'identity:token' with a token of at least 16 characters")
        if token in tokens:
            raise ValueError(f"{path} line {number}: this token is already given to {tokens[token]!r}")
        tokens[token] = identity
    if not tokens:
        raise ValueError(f"{path} holds no 'identity:token' lines")
    return tokens


def check_key_pair(cert_file: str, key_file: str) -> None:
    """ValueError unless the key fits the certificate (a renewal may have written one file and
    not yet the other)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"the TLS key {key_file!r} does not fit the certificate {cert_file!r}, or one of them "
            f"is not PEM ({exc.__class__.__name__}: {getattr(exc, 'reason', None) or exc})"
        ) from None


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key, and the CA its clients' certificates must chain to (mTLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        """The files as they are now; ValueError when one cannot be read or the key does not fit
        the certificate."""
        key = read_secret_file(self.key_file, "TLS key")
        cert = read_secret_file(self.cert_file, "TLS certificate")
        ca = read_secret_file(self.client_ca_file, "TLS client CA") if self.client_ca_file else None
        check_key_pair(self.cert_file, self.key_file)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials that read the files again, for the connections that follow, once they
        change (a renewed certificate is served without a restart); files that cannot be read or
        do not fit together leave the ones in use."""
        files = [f for f in (self.cert_file, self.key_file, self.client_ca_file) if f]
        configuration = Reloaded(
            files, self._configuration, "tls_certificate", "certificate",
            cert_file=self.cert_file, client_ca_file=self.client_ca_file,
        )  # fmt: skip
        lock = threading.Lock()  # grpc asks on each new connection, from its own threads

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            with lock:
                return configuration.value if configuration.renew() else None

        return grpc.dynamic_ssl_server_credentials(
            configuration.value, fetch, require_client_authentication=self.client_ca_file is not None
        )


class Authenticator:
    """Decides who is calling: a bearer token from the table, and/or an allowed client certificate."""

    def __init__(
        self,
        tokens: dict[str, str] | None = None,
        allowed_cert_names: Sequence[str] = (),
        tokens_file: str | None = None,
    ) -> None:
        """The tokens: ``tokens``, or instead those of ``tokens_file`` (see ``load_tokens``), read
        again when it changes."""
        self._file: Reloaded[dict[str, str]] | None = None
        if tokens_file:
            path = tokens_file
            self._file = Reloaded([path], lambda: load_tokens(path), "auth_tokens", "table of tokens", file=path)
        self._tokens = self._file.value if self._file else tokens or {}
        self._allowed = frozenset(allowed_cert_names)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens or self._allowed)

    def authenticate(self, metadata: Sequence[tuple[str, Any]], peer: dict[str, list[bytes]]) -> str:
        """The caller's identity; raises Unauthenticated / PermissionDenied.

        ``metadata`` is the call's invocation metadata, ``peer`` its auth context.
        """
        if self._file is not None:
            self._tokens = self._file.current()
        identity = ""
        if self._allowed:
            names = {n.decode(errors="replace") for key in _CERT_NAME_KEYS for n in peer.get(key, [])}
            allowed = sorted(names & self._allowed)
            if not allowed:
                raise PermissionDenied("the client certificate is not allowed to call this service")
            identity = allowed[0]
        if self._tokens:
            identity = self._token_identity(metadata)
        return identity

    def _token_identity(self, metadata: Sequence[tuple[str, Any]]) -> str:
        values = [v for k, v in metadata if k == _AUTH_HEADER]
        if not values:
            raise Unauthenticated("missing credentials: send the metadata 'authorization: Bearer <token>'")
        scheme, _, presented = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise Unauthenticated("malformed credentials: expected 'authorization: Bearer <token>'")
        found = ""
        for token, identity in self._tokens.items():  # compare with every token: no timing oracle
            if hmac.compare_digest(token.encode(), presented.strip().encode()):
                found = identity
        if not found:
            raise Unauthenticated("invalid token")
        return found


def scoped_session_id(identity: str, session_id: str) -> str:
    """The session's key: callers' sessions live in separate namespaces, so one caller can never
    continue, read or close another's session (it simply does not exist for them)."""
    if not identity:
        return session_id
    return f"{hashlib.sha256(identity.encode()).hexdigest()[:16]}.{session_id}"


@dataclass(frozen=True)
class ClientSecurity:
    """How the coordinator reaches workers: TLS (with a client certificate for mTLS) and a token."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None
    token_file: str | None = None

    def metadata(self) -> CallMetadata:
        """Metadata to send with every call: the bearer token, when there is one."""
        return CallMetadata(self.token_file)

    def channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        """A channel to ``address``: TLS (mTLS with a client certificate) when a CA is set."""
        if self.ca_file is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        opts = list(options)
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        if self.cert_file and self.key_file:
            check_key_pair(self.cert_file, self.key_file)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=read_secret_file(self.ca_file, "worker TLS CA"),
            private_key=read_secret_file(self.key_file, "worker TLS client key") if self.key_file else None,
            certificate_chain=read_secret_file(self.cert_file, "worker TLS client certificate")
            if self.cert_file
            else None,
        )
        return grpc.aio.secure_channel(address, credentials, options=opts)


class CallMetadata:
    """What a client sends with every call (``metadata()``): the bearer token from its file,
    read again when the file changes (the workers' token is rotated without a restart)."""

    def __init__(self, token_file: str | None) -> None:
        self._token = secret_file(token_file, "worker token", "worker_token") if token_file else None

    def __call__(self) -> tuple[tuple[str, str], ...]:
        return () if self._token is None else ((_AUTH_HEADER, f"Bearer {self._token.current()}"),)


def secret_file(path: str, what: str, event: str) -> Reloaded[str]:
    """A secret held in a file (a token, a password), read again when the file changes."""
    return Reloaded([path], lambda: read_secret_file(path, what).decode().strip(), event, what, file=path)
