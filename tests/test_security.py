"""TLS/mTLS on every hop, bearer tokens, caller-bound sessions, Redis AUTH over TLS.

One cluster (separate processes) runs fully secured: the coordinator serves TLS and wants a
token; the workers serve mTLS, accept only the coordinator's certificate name, and also want a
shared token; the state store is a password-protected, TLS-only redis-server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from transformers import AutoTokenizer

from specdec.serving.errors import PermissionDenied, StateUnavailable, Unauthenticated
from specdec.serving.security import Authenticator, load_tokens, scoped_session_id
from specdec.state import Commit, open_store
from specdec.tools.launch import LaunchError, LocalCluster, spawn
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc, target_pb2, target_pb2_grpc
from tests.clusters import wait_for
from tests.helpers import RedisServer, free_port, free_ports
from tests.netproxy import ProxyRoutes
from tests.reference import make_request, reference_greedy
from tests.tiny_models import TinyModels

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef"
WORKER_TOKEN = "worker-token-0123456789abcdef"
REDIS_PASSWORD = "redis-Pa55word-never-logged"
PROMPT = [5, 9, 13, 2, 7]
SESSIONS_PER_CALLER = 2  # the module's coordinator: --max-sessions-per-caller
TOKENS_PER_CALLER = 40  # and --max-session-tokens-per-caller


@dataclass
class Pki:
    ca: trustme.CA
    dir: Path

    def write(self, name: str, cert: trustme.LeafCert) -> tuple[Path, Path]:
        cert_file, key_file = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        cert.private_key_and_cert_chain_pem.write_to_path(str(cert_file))
        cert.private_key_pem.write_to_path(str(key_file))
        return cert_file, key_file

    @property
    def ca_file(self) -> Path:
        path = self.dir / "ca.pem"
        self.ca.cert_pem.write_to_path(str(path))
        return path


@dataclass
class SecureCluster:
    cluster: LocalCluster
    pki: Pki
    redis: RedisServer

    @property
    def state_url(self) -> str:  # the password goes in a setting, not in the URL
        return f"rediss://127.0.0.1:{self.redis.port}/0"

    def channel(self, ca_file: Path | None = None) -> grpc.Channel:
        credentials = grpc.ssl_channel_credentials((ca_file or self.pki.ca_file).read_bytes())
        return grpc.secure_channel(self.cluster.address, credentials)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[SecureCluster]:
    workdir = tmp_path_factory.mktemp("secure")
    pki = Pki(trustme.CA(), workdir)
    server_cert, server_key = pki.write("server", pki.ca.issue_cert("localhost", "127.0.0.1"))
    client_cert, client_key = pki.write("coordinator", pki.ca.issue_cert("coordinator.specdec"))
    redis = RedisServer(workdir / "redis", password=REDIS_PASSWORD, tls=(server_cert, server_key))
    tokens = _write(workdir / "api-tokens", f"# callers\nalice:{ALICE}\nbob:{BOB}\n")
    worker_tokens = _write(workdir / "worker-tokens", f"coordinator:{WORKER_TOKEN}\n")
    worker_token = _write(workdir / "worker-token", WORKER_TOKEN + "\n")
    tls = ["--tls-cert-file", str(server_cert), "--tls-key-file", str(server_key), "--health-port", "0"]
    worker_args = [
        "--device", "cpu", "--torch-threads", "1", *tls, "--tls-client-ca-file", str(pki.ca_file),
        "--tls-allowed-client-names", "coordinator.specdec", "--auth-tokens-file", str(worker_tokens),
    ]  # fmt: skip
    coordinator_args = [
        *tls, "--auth-tokens-file", str(tokens), "--state-url", f"rediss://127.0.0.1:{redis.port}/0",
        "--state-password", REDIS_PASSWORD,
        "--state-tls-ca-file", str(pki.ca_file), "--worker-tls-ca-file", str(pki.ca_file),
        "--worker-tls-cert-file", str(client_cert), "--worker-tls-key-file", str(client_key),
        "--worker-token-file", str(worker_token), "--log-level", "debug", "--local-port", "0",
        "--max-sessions-per-caller", str(SESSIONS_PER_CALLER),
        "--max-session-tokens-per-caller", str(TOKENS_PER_CALLER),
    ]  # fmt: skip
    cluster = LocalCluster(
        str(tiny_models.target), str(tiny_models.other), workdir, worker_args, coordinator_args=coordinator_args
    )
    try:
        with cluster:
            yield SecureCluster(cluster, pki, redis)
    finally:
        redis.stop()


def _generate(
    secure: SecureCluster, token: str | None, require_existing: bool = False, **kwargs: object
) -> coordinator_pb2.GenerateResponse:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    prompt = kwargs.pop("prompt", PROMPT)
    request = make_request(prompt, **kwargs)  # type: ignore[arg-type]
    request.require_existing_session = require_existing
    with secure.channel() as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        return stub.Generate(request, metadata=metadata, timeout=60)


def _close(secure: SecureCluster, token: str, name: str) -> bool:
    """CloseSession for the caller of ``token``: whether it closed a session."""
    with secure.channel() as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        request = coordinator_pb2.CloseSessionRequest(session_id=name)
        return stub.CloseSession(request, metadata=[("authorization", f"Bearer {token}")]).existed


def _code(fn: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()  # type: ignore[operator]
    return info.value.code(), info.value.details() or ""


def test_secured_end_to_end_is_exact(secure: SecureCluster, tiny_models: TinyModels) -> None:
    reply = _generate(secure, ALICE, max_new=16, ignore_eos=True)
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(PROMPT), 16, ignore_eos=True)
    assert reply.stats.draft_tokens_proposed > 0  # the mTLS + token hop to the draft worked too


def test_plaintext_client_is_refused(secure: SecureCluster) -> None:
    with grpc.insecure_channel(secure.cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        metadata = [("authorization", f"Bearer {ALICE}")]
        code, _ = _code(lambda: stub.Generate(make_request(PROMPT), metadata=metadata, timeout=10))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_another_ca_is_refused(secure: SecureCluster, tmp_path: Path) -> None:
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    with secure.channel(other_ca) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        metadata = [("authorization", f"Bearer {ALICE}")]
        code, _ = _code(lambda: stub.Generate(make_request(PROMPT), metadata=metadata, timeout=10))
    assert code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", [None, "not-a-valid-token-at-all-000"])
def test_missing_or_bad_token_is_unauthenticated(secure: SecureCluster, token: str | None) -> None:
    code, details = _code(lambda: _generate(secure, token))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "Bearer" in details or "invalid token" in details
    assert ALICE not in details and BOB not in details


def test_sessions_are_bound_to_their_caller(secure: SecureCluster) -> None:
    first = _generate(secure, ALICE, max_new=4, session_id="shared-name")
    assert len(first.token_ids) == 4
    code, _ = _code(lambda: _generate(secure, BOB, session_id="shared-name", max_new=4, require_existing=True))
    assert code == grpc.StatusCode.NOT_FOUND
    with secure.channel() as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        closed = stub.CloseSession(
            coordinator_pb2.CloseSessionRequest(session_id="shared-name"), metadata=[("authorization", f"Bearer {BOB}")]
        )
        assert not closed.existed  # bob cannot close alice's session ...
        again = _generate(secure, ALICE, max_new=4, session_id="shared-name", require_existing=True)
        assert again.usage.cached_tokens > 0  # ... which still continues from its cache
        closed = stub.CloseSession(
            coordinator_pb2.CloseSessionRequest(session_id="shared-name"),
            metadata=[("authorization", f"Bearer {ALICE}")],
        )
        assert closed.existed


def test_a_caller_at_its_session_limit_is_refused_a_new_one_and_others_are_not(
    secure: SecureCluster, tiny_models: TinyModels
) -> None:
    """--max-sessions-per-caller through the running service: alice, holding as many named
    sessions as the limit, is refused a new one (RESOURCE_EXHAUSTED, saying what to do), while her
    sessions go on, her one-shot requests are served, and bob's sessions are his own count; once
    she closes one, the new one is served, exact. Main had no limit: one caller's sessions could
    fill Redis, and a full Redis refuses everyone."""
    names = [f"limit-{i}" for i in range(SESSIONS_PER_CALLER + 1)]
    with secure.channel() as channel:  # clients can read the limit
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        info = stub.GetInfo(coordinator_pb2.GetInfoRequest(), metadata=[("authorization", f"Bearer {ALICE}")])
        assert info.max_sessions_per_caller == SESSIONS_PER_CALLER and info.max_requests_per_caller == 0

    try:
        for name in names[:-1]:
            assert len(_generate(secure, ALICE, max_new=2, session_id=name).token_ids) == 2
        code, details = _code(lambda: _generate(secure, ALICE, max_new=2, session_id=names[-1]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert f"{SESSIONS_PER_CALLER} sessions open" in details and "CloseSession" in details
        assert len(_generate(secure, ALICE, max_new=2, session_id=names[0], require_existing=True).token_ids) == 2
        assert len(_generate(secure, ALICE, max_new=2).token_ids) == 2  # one-shot: counted for nobody
        for name in names[1:]:
            assert len(_generate(secure, BOB, max_new=2, session_id=name).token_ids) == 2
        assert _close(secure, ALICE, names[1])
        reply = _generate(secure, ALICE, max_new=8, session_id=names[-1], ignore_eos=True)
        assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(PROMPT), 8, ignore_eos=True)
    finally:
        for token in (ALICE, BOB):
            for name in names:
                _close(secure, token, name)


def test_a_caller_whose_sessions_hold_its_budget_of_tokens_is_refused_and_others_are_not(
    secure: SecureCluster, tiny_models: TinyModels
) -> None:
    """--max-session-tokens-per-caller through the running service: once alice's named sessions
    hold 40 tokens or more (a 35-token session, then a 7-token one: a turn under the budget may
    pass it), a request that would continue one or make another is refused (RESOURCE_EXHAUSTED,
    saying how many they hold and what to do), while her one-shot requests and bob's sessions are
    served; once she closes one, a new session is served, exact. Main bounded only how many
    sessions a caller holds, each of which could grow to the context length."""
    names = ["budget-0", "budget-1", "budget-2"]
    with secure.channel() as channel:  # clients can read the budget
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        info = stub.GetInfo(coordinator_pb2.GetInfoRequest(), metadata=[("authorization", f"Bearer {ALICE}")])
        assert info.max_session_tokens_per_caller == TOKENS_PER_CALLER

    try:
        assert len(_generate(secure, ALICE, max_new=30, session_id=names[0], ignore_eos=True).token_ids) == 30
        assert len(_generate(secure, ALICE, max_new=2, session_id=names[1], ignore_eos=True).token_ids) == 2
        for name, existing in ((names[0], True), (names[2], False)):
            code, details = _code(
                lambda name=name, existing=existing: _generate(
                    secure, ALICE, max_new=2, session_id=name, require_existing=existing
                )
            )
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
            assert "your sessions hold 42 tokens" in details and "CloseSession" in details
        assert len(_generate(secure, ALICE, max_new=2).token_ids) == 2  # one-shot: counted for nobody
        assert len(_generate(secure, BOB, max_new=30, session_id=names[0], ignore_eos=True).token_ids) == 30
        assert _close(secure, ALICE, names[0])
        reply = _generate(secure, ALICE, max_new=8, session_id=names[2], ignore_eos=True)
        assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(PROMPT), 8, ignore_eos=True)
    finally:
        for token in (ALICE, BOB):
            for name in names:
                _close(secure, token, name)


def test_engine_request_ids_are_bound_to_their_caller(secure: SecureCluster, tiny_models: TinyModels) -> None:
    """The engine API's Abort names request ids, which clients choose: like session ids they are
    per caller, so bob aborting "req-1" leaves alice's "req-1" running (before, it was cancelled)."""
    alice, bob = ([("authorization", f"Bearer {token}")] for token in (ALICE, BOB))
    params = vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    request = vllm_engine_pb2.GenerateRequest(
        request_id="req-1",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=PROMPT),
        sampling_params=params,
        stream=True,
    )
    with secure.channel() as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        stream = stub.Generate(request, metadata=alice, timeout=60)
        first = next(stream)
        stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["req-1"]), metadata=bob, timeout=10)
        rest = list(stream)
    assert rest[-1].complete.finish_reason == "length"
    tokens = [t for r in [first, *rest] if r.HasField("chunk") for t in r.chunk.token_ids]
    assert tokens == reference_greedy(str(tiny_models.target), tuple(PROMPT), 200, ignore_eos=True)
    with secure.channel() as channel:  # and alice's own Abort still works
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        stream = stub.Generate(request, metadata=alice, timeout=60)
        next(stream)
        stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["req-1"]), metadata=alice, timeout=10)
        assert list(stream)[-1].complete.finish_reason == "abort"


def _target_stub(secure: SecureCluster, cert: tuple[Path, Path] | None) -> tuple[grpc.Channel, object]:
    key_pem = cert[1].read_bytes() if cert else None
    chain_pem = cert[0].read_bytes() if cert else None
    credentials = grpc.ssl_channel_credentials(secure.pki.ca_file.read_bytes(), key_pem, chain_pem)
    channel = grpc.secure_channel(secure.cluster.processes["target-0"].address, credentials)
    return channel, target_pb2_grpc.TargetWorkerStub(channel)


def test_workers_accept_only_the_coordinator(secure: SecureCluster) -> None:
    info = target_pb2.TargetInfoRequest()
    token = [("authorization", f"Bearer {WORKER_TOKEN}")]
    # No client certificate: the TLS handshake fails.
    channel, stub = _target_stub(secure, None)
    with channel:
        assert _code(lambda: stub.Info(info, metadata=token, timeout=10))[0] == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    # A certificate from the right CA but for another name: permission denied.
    stranger = secure.pki.write("stranger", secure.pki.ca.issue_cert("client.example"))
    channel, stub = _target_stub(secure, stranger)
    with channel:
        assert _code(lambda: stub.Info(info, metadata=token, timeout=10))[0] == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    # The coordinator's certificate without the shared token: unauthenticated; with it: served.
    coordinator = (secure.pki.dir / "coordinator.crt", secure.pki.dir / "coordinator.key")
    channel, stub = _target_stub(secure, coordinator)
    with channel:
        assert _code(lambda: stub.Info(info, timeout=10))[0] == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        assert stub.Info(info, metadata=token, timeout=10).info.vocab_size > 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("role", ["coordinator", "target-0", "draft"])
def test_probes_answer_in_plaintext_on_the_health_port(secure: SecureCluster, role: str) -> None:
    port = secure.cluster.processes[role].health_port
    assert port and port != secure.cluster.processes[role].port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("specdec.liveness", "specdec.readiness", "specdec.startup"):
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING, service
        # Only health lives there: the API is not reachable without TLS.
        api = coordinator_pb2_grpc.GenerationStub(channel)
        assert _code(lambda: api.Generate(make_request(PROMPT), timeout=5))[0] == grpc.StatusCode.UNIMPLEMENTED


def test_redis_password_never_reaches_logs(secure: SecureCluster) -> None:
    _generate(secure, ALICE, max_new=2)
    for process in secure.cluster.processes.values():
        assert REDIS_PASSWORD not in process.log_file.read_text(errors="replace"), process.role


def test_wrong_redis_password_fails_start_up_clearly(secure: SecureCluster, tmp_path: Path) -> None:
    target = secure.cluster.processes["target-0"]
    args = [
        "--target-addresses", target.address, "--state-url", secure.state_url, "--state-password", "wrong-password",
        "--state-tls-ca-file", str(secure.pki.ca_file), "--worker-tls-ca-file", str(secure.pki.ca_file),
        "--worker-tls-cert-file", str(secure.pki.dir / "coordinator.crt"),
        "--worker-tls-key-file", str(secure.pki.dir / "coordinator.key"),
        "--worker-token-file", str(secure.pki.dir / "worker-token"),
    ]  # fmt: skip
    process = spawn("coordinator", args, tmp_path)
    with pytest.raises(LaunchError):
        process.wait_ready(60)
    log = process.log_file.read_text()
    assert "refused the coordinator (AuthenticationError" in log and "--state-password-file" in log
    assert "wrong-password" not in log and "Traceback" not in log


def test_unreadable_credentials_stop_start_up_with_a_clear_message(tmp_path: Path) -> None:
    process = spawn(
        "coordinator", ["--target-addresses", "127.0.0.1:1", "--auth-tokens-file", "/nonexistent"], tmp_path
    )
    with pytest.raises(LaunchError):
        process.wait_ready(60)
    assert process.proc.returncode == 2
    assert "cannot read the auth tokens file '/nonexistent'" in process.log_file.read_text()


def _replace(path: Path, data: bytes) -> None:
    """Writes ``path`` in one step (a Secret volume's update swaps in complete files)."""
    staged = path.with_name(path.name + ".new")
    staged.write_bytes(data)
    staged.replace(path)


def _pem(*blobs: trustme.Blob) -> bytes:
    return b"".join(blob.bytes() for blob in blobs)


def test_credentials_are_rotated_without_a_restart(tmp_path: Path, tiny_models: TinyModels) -> None:
    """Tokens and certificates replaced in place, as a Secret update or cert-manager's renewal
    does: every service read them once at start, so a revoked token stayed valid and renewed
    certificates went unused (their predecessors expired under the running pods) until a
    restart. Now the API tokens, the workers' tokens, the token the coordinator sends to the
    workers, each server's certificate, key and client CA, and the coordinator's client
    certificate, key and CA for the workers are read again when their files change; a file that
    does not parse, or a key that does not fit its certificate, leaves the credentials in use as
    they are (with a warning)."""
    ca1 = trustme.CA()
    ca1_file = _write(tmp_path / "ca1.pem", ca1.cert_pem.bytes().decode())
    files = {  # name -> the certificate whose key and chain the files hold at first (all CA1's)
        "coordinator": ca1.issue_cert("localhost", "127.0.0.1"),
        "worker": ca1.issue_cert("localhost", "127.0.0.1"),
        "client": ca1.issue_cert("coordinator.specdec"),
    }
    for name, leaf in files.items():
        _write(tmp_path / f"{name}.crt", _pem(*leaf.cert_chain_pems).decode())
        _write(tmp_path / f"{name}.key", leaf.private_key_pem.bytes().decode())
    worker_ca, client_ca = (_write(tmp_path / f"{n}-ca.pem", ca1_file.read_text()) for n in ("worker", "client"))
    carol = "carol-token-0123456789abcdef"
    new_worker_token = "worker-token-next-0123456789abcdef"
    tokens = _write(tmp_path / "api-tokens", f"alice:{ALICE}\n")
    worker_tokens = _write(tmp_path / "worker-tokens", f"coordinator:{WORKER_TOKEN}\n")
    worker_token = _write(tmp_path / "worker-token", WORKER_TOKEN + "\n")
    worker_args = [
        "--device", "cpu", "--torch-threads", "1", "--tls-cert-file", str(tmp_path / "worker.crt"),
        "--tls-key-file", str(tmp_path / "worker.key"), "--tls-client-ca-file", str(client_ca),
        "--tls-allowed-client-names", "coordinator.specdec", "--auth-tokens-file", str(worker_tokens),
    ]  # fmt: skip
    coordinator_args = [
        "--tls-cert-file", str(tmp_path / "coordinator.crt"), "--tls-key-file", str(tmp_path / "coordinator.key"),
        "--auth-tokens-file", str(tokens), "--worker-tls-ca-file", str(worker_ca),
        "--worker-tls-cert-file", str(tmp_path / "client.crt"), "--worker-tls-key-file", str(tmp_path / "client.key"),
        "--worker-token-file", str(worker_token), "--state-url", "memory://",
    ]  # fmt: skip
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), 8, ignore_eos=True)
    links = ProxyRoutes(roles=("target", "draft"))  # to make the coordinator connect to the workers anew
    cluster = LocalCluster(
        str(tiny_models.target), str(tiny_models.same), tmp_path, worker_args, coordinator_args=coordinator_args,
        route=links,
    )  # fmt: skip

    def generate(token: str, ca_file: Path) -> coordinator_pb2.GenerateResponse:
        credentials = grpc.ssl_channel_credentials(ca_file.read_bytes())
        with grpc.secure_channel(cluster.address, credentials) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            request = make_request(PROMPT, max_new=8, ignore_eos=True)
            return stub.Generate(request, metadata=[("authorization", f"Bearer {token}")], timeout=60)

    def refused(token: str, ca_file: Path) -> grpc.StatusCode | None:
        try:
            generate(token, ca_file)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
        return None

    def settle() -> None:  # the services look at their files once a second
        time.sleep(1.5)

    try:
        with cluster:
            assert list(generate(ALICE, ca1_file).token_ids) == expected
            # API tokens: alice's revoked, carol's issued; then a file that does not parse
            _replace(tokens, f"carol:{carol}\n".encode())
            wait_for(lambda: refused(ALICE, ca1_file) == grpc.StatusCode.UNAUTHENTICATED, 10, 0.2)
            assert list(generate(carol, ca1_file).token_ids) == expected
            _replace(tokens, b"carol\n")
            settle()
            assert list(generate(carol, ca1_file).token_ids) == expected
            # the workers' token: both accepted, the coordinator switches, the old one is revoked
            _replace(worker_tokens, f"coordinator:{WORKER_TOKEN}\ncoordinator:{new_worker_token}\n".encode())
            settle()
            _replace(worker_token, (new_worker_token + "\n").encode())
            settle()
            _replace(worker_tokens, f"coordinator:{new_worker_token}\n".encode())
            settle()
            reply = generate(carol, ca1_file)
            assert list(reply.token_ids) == expected
            assert reply.stats.draft_tokens_proposed > reply.stats.lookup_tokens_proposed  # the draft took it too
            # the coordinator's certificate, renewed by another CA: the key first, fitting no certificate yet
            ca2 = trustme.CA()
            renewed = ca2.issue_cert("localhost", "127.0.0.1")
            _replace(tmp_path / "coordinator.key", renewed.private_key_pem.bytes())
            settle()
            assert list(generate(carol, ca1_file).token_ids) == expected  # the pair in use stays
            _replace(tmp_path / "coordinator.crt", _pem(*renewed.cert_chain_pems))
            ca2_file = _write(tmp_path / "ca2.pem", ca2.cert_pem.bytes().decode())
            wait_for(lambda: refused(carol, ca2_file) is None, 10, 0.2)
            assert refused(carol, ca1_file) == grpc.StatusCode.UNAVAILABLE
            # the hop to the workers moves to CA3: both sides trust both CAs, then both take CA3's
            # certificates, then trust CA3 alone; new connections need the new certificates
            ca3 = trustme.CA()
            for path in (worker_ca, client_ca):
                _replace(path, _pem(ca1.cert_pem, ca3.cert_pem))
            settle()
            for name, leaf in (
                ("worker", ca3.issue_cert("localhost", "127.0.0.1")),
                ("client", ca3.issue_cert("coordinator.specdec")),
            ):
                _replace(tmp_path / f"{name}.key", leaf.private_key_pem.bytes())
                _replace(tmp_path / f"{name}.crt", _pem(*leaf.cert_chain_pems))
            settle()
            for path in (worker_ca, client_ca):
                _replace(path, ca3.cert_pem.bytes())
            settle()
            for proxy in links.proxies.values():
                proxy.reset_connections()
            reply = generate(carol, ca2_file)
            assert list(reply.token_ids) == expected
            assert reply.stats.draft_tokens_proposed > reply.stats.lookup_tokens_proposed
            coordinator = cluster.processes["coordinator"].log_tail(400)
            worker = cluster.processes["target-0"].log_tail(400)
    finally:
        links.close()
    for event in ("auth_tokens_reloaded", "auth_tokens_not_reloaded", "tls_certificate_reloaded"):
        assert event in coordinator, event
    assert "tls_certificate_not_reloaded" in coordinator and "worker_token_reloaded" in coordinator
    assert "worker_tls_reloaded" in coordinator
    assert "auth_tokens_reloaded" in worker and "tls_certificate_reloaded" in worker
    for secret in (ALICE, carol, WORKER_TOKEN, new_worker_token):
        assert secret not in coordinator + worker


def test_a_rotated_redis_password_is_used_for_new_connections(tmp_path: Path, tiny_models: TinyModels) -> None:
    """The Redis password changed (CONFIG SET requirepass, or a second ACL password) and its file
    updated: connections made from then on authenticate with the new one. Main read the file once,
    so once Redis dropped the coordinator's connections every request failed UNAVAILABLE until a
    restart."""
    import redis

    old, new = "redis-old-Pa55word-0123", "redis-new-Pa55word-4567"
    server = RedisServer(tmp_path / "redis", password=old)
    password_file = _write(tmp_path / "redis-password", old + "\n")
    args = ["--state-url", f"redis://127.0.0.1:{server.port}/0", "--state-password-file", str(password_file)]
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), 8, ignore_eos=True)
    cluster = LocalCluster(
        str(tiny_models.target), None, tmp_path, ["--device", "cpu", "--torch-threads", "1"], coordinator_args=args
    )
    try:
        with cluster, grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            request = make_request(PROMPT, max_new=8, ignore_eos=True)
            assert list(stub.Generate(request, timeout=60).token_ids) == expected
            admin = redis.Redis(port=server.port, password=old)
            admin.config_set("requirepass", new)
            _replace(password_file, (new + "\n").encode())
            time.sleep(1.5)
            admin.client_kill_filter(_type="normal", skipme=False)  # the coordinator's connections go
            assert list(stub.Generate(request, timeout=60).token_ids) == expected
            log = cluster.processes["coordinator"].log_tail(400)
    finally:
        server.stop()
    assert "state_password_reloaded" in log and old not in log and new not in log


def test_a_key_that_does_not_fit_its_certificate_stops_start_up_saying_so(tmp_path: Path) -> None:
    """Main said "could not bind 0.0.0.0:PORT; is the port in use?" (grpc refuses the port)."""
    pki = Pki(trustme.CA(), tmp_path)
    cert, _ = pki.write("one", pki.ca.issue_cert("localhost"))
    _, other_key = pki.write("two", pki.ca.issue_cert("localhost"))
    args = ["--target-addresses", "127.0.0.1:1", "--tls-cert-file", str(cert), "--tls-key-file", str(other_key)]
    process = spawn("coordinator", args, tmp_path)
    with pytest.raises(LaunchError):
        process.wait_ready(60)
    assert process.proc.returncode == 2
    log = process.log_file.read_text()
    assert f"the TLS key '{other_key}' does not fit the certificate '{cert}'" in log and "port in use" not in log


# Unit checks of the pieces.


def test_tokens_file_format(tmp_path: Path) -> None:
    good = _write(tmp_path / "good", f"# comment\n\nalice:{ALICE}\n bob : {BOB} \n")
    assert load_tokens(str(good)) == {ALICE: "alice", BOB: "bob"}
    for text, message in [
        ("alice\n", "identity:token"),
        ("alice:short\n", "at least 16"),
        (f"a:{ALICE}\nb:{ALICE}\n", "already given"),
        ("# nothing\n", "no 'identity:token'"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            load_tokens(str(_write(tmp_path / "bad", text)))
        assert ALICE not in str(info.value)


def test_the_gateway_sidecar_path_loopback_port_without_token(secure: SecureCluster, tiny_models: TinyModels) -> None:
    """The deployment's gateway path: smg (which sends no token and speaks plaintext gRPC to its
    workers) in the coordinator's pod, on the loopback-only --local-port; the public port still
    needs TLS and a token from everybody, and the local port listens on 127.0.0.1 only."""
    import openai

    local = secure.cluster.processes["coordinator"].local_port
    with grpc.insecure_channel(f"127.0.0.1:{local}") as channel:
        assert vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(vllm_engine_pb2.HealthCheckRequest()).healthy
    with secure.channel() as channel:
        code, _ = _code(lambda: vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(
            vllm_engine_pb2.HealthCheckRequest(), timeout=30))  # fmt: skip
        assert code == grpc.StatusCode.UNAUTHENTICATED
    assert _reachable("127.0.0.1", local) and not _reachable(_host_address(), local)
    (port, metrics_port), log = free_ports(2), secure.pki.dir / "gateway.log"
    command = [
        str(Path(sys.executable).with_name("smg")), "launch", "--backend", "vllm", "--host", "127.0.0.1",
        "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-urls", f"grpc://127.0.0.1:{local}", "--model-path", str(tiny_models.target),
    ]  # fmt: skip
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
        deadline, text = time.monotonic() + 120, None
        while text is None:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                model = client.models.list().data[0].id
                reply = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0)
                text = reply.choices[0].text
            except (openai.APIError, IndexError):
                time.sleep(0.5)
        ids = AutoTokenizer.from_pretrained(str(tiny_models.target))("Hello")["input_ids"]
        native = _generate(secure, ALICE, prompt=ids, max_new=6, fixed=False).text
        # random byte tokens: the gateway drops an incomplete trailing character, we show U+FFFD
        assert text.rstrip("\ufffd") == native.rstrip("\ufffd") and reply.usage.completion_tokens == 6
    finally:
        process.terminate()
        process.wait(timeout=30)


def _host_address() -> str:
    """This host's address on its outbound interface (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))
        return str(probe.getsockname()[0])


def _reachable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) == 0


def test_authenticator_decisions() -> None:
    auth = Authenticator({ALICE: "alice"}, ["coordinator.specdec"])
    peer = {"x509_subject_alternative_name": [b"coordinator.specdec"]}
    assert auth.authenticate([("authorization", f"Bearer {ALICE}")], peer) == "alice"
    with pytest.raises(PermissionDenied):
        auth.authenticate([("authorization", f"Bearer {ALICE}")], {"x509_common_name": [b"other"]})
    for metadata in ([], [("authorization", ALICE)], [("authorization", "Bearer nope")]):
        with pytest.raises(Unauthenticated):
            auth.authenticate(metadata, peer)
    assert Authenticator(None, ["coordinator.specdec"]).authenticate([], peer) == "coordinator.specdec"
    assert not Authenticator().enabled


def test_session_scopes() -> None:
    assert scoped_session_id("", "s") == "s"
    assert scoped_session_id("alice", "s") != scoped_session_id("bob", "s")
    assert scoped_session_id("alice", "s").endswith(".s")


def test_a_password_in_two_places_is_refused() -> None:
    with pytest.raises(ValueError, match="given twice"):
        open_store("redis://:in-url@127.0.0.1:1/0", 60, 60, 1, password="in-setting")
    with pytest.raises(ValueError, match="given twice"):
        open_store("redis://127.0.0.1:1/0", 60, 60, 1, password="in-setting", password_file="/in/a/file")


def test_a_redis_user_in_two_places_is_refused() -> None:
    """A user in --state-url and another in --state-username: redis-py took the URL's without a
    word (the setting's documentation said the setting wins)."""
    with pytest.raises(ValueError, match="user is given twice"):
        open_store("redis://in-url@127.0.0.1:1/0", 60, 60, 1, username="in-setting")


def test_redis_acl_user_is_supported(tmp_path: Path) -> None:
    """An ACL user limited to specdec's keys works, its name given as a setting or in the URL and
    its password as a setting or in a file; a wrong user/password is refused clearly."""
    acl = ["--user", "specdec", "on", ">acl-Pa55word-0123", "~specdec:*", "&*", "+@all", "--user", "default", "off"]
    redis = RedisServer(tmp_path / "redis", extra_args=acl)
    url = f"redis://127.0.0.1:{redis.port}/0"
    password_file = _write(tmp_path / "redis-password", "acl-Pa55word-0123\n")

    async def use(username: str, password: str | None, store_url: str = url, file: Path | None = None) -> int:
        store = open_store(
            store_url, 60, 60, 2, username=username or None, password=password, password_file=file and str(file)
        )
        try:
            await store.start()
            await store.acquire("acl-session", "o", create=True)
            result = await store.commit("acl-session", "o", Commit(0, "s0", [1, 2, 3]))
            return result.version
        finally:
            await store.close()

    try:
        assert asyncio.run(use("specdec", "acl-Pa55word-0123")) == 1
        assert asyncio.run(use("specdec", None, file=password_file)) == 1
        # the user in the URL with the password in a file (main, with the file read once: the same)
        assert asyncio.run(use("", None, f"redis://specdec@127.0.0.1:{redis.port}/0", password_file)) == 1
        with pytest.raises(StateUnavailable) as info:
            asyncio.run(use("specdec", "wrong-password-0123"))
        assert "AuthenticationError" in str(info.value) and "wrong-password" not in str(info.value)
    finally:
        redis.stop()


def test_a_coordinator_waiting_for_its_workers_is_not_ready_and_says_why(tmp_path: Path) -> None:
    """A coordinator waiting for its workers: alive, not started, not ready (k8s keeps it out), and
    its log says which worker it waits for and what that worker last answered, at once and then
    every 10 s (main waited up to --worker-startup-timeout-s, 600 s, without a line; then its first
    line came only after 10 s)."""
    port = free_port()
    args = ["--target-addresses", "127.0.0.1:1", "--health-port", str(port), "--worker-startup-timeout-s", "60"]
    process = spawn("coordinator", args, tmp_path)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

            assert status("specdec.liveness") == health_pb2.HealthCheckResponse.SERVING
            assert status("specdec.startup") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert status("specdec.readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        waited = wait_for(lambda: "waiting_for_worker" in process.log_tail(), 30, 0.2)
        line = next(json.loads(x) for x in process.log_tail().splitlines() if "waiting_for_worker" in x)
        assert line["role"] == "target" and line["address"] == "127.0.0.1:1" and line["status"] == "UNAVAILABLE"
        assert line["level"] == "info" and line["waited_s"] < 5 and waited < 5, (line, waited)
    finally:
        process.stop()
