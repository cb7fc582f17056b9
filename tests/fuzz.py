"""Fuzzing the requests a client can send: Hypothesis strategies for any value of a field's type,
a message with a few of its fields set to such values, a native request with its features within
the limits; and ``sent_at_once``, which sends such requests to a running cluster at once and fails
the test where the service, not the request, was at fault."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import event
from hypothesis import strategies as st

from specdec.state import SessionRecord
from specdec.tools.launch import LocalCluster
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.clusters import metric
from tests.helpers import stored_sessions
from tests.reference import find_session

SMALLEST_FLOAT32 = 2.0**-149  # the smallest positive (denormal) float32
# Values within a sampling parameter's limits, its edges often (the native and the engine API's
# strategies both draw from these)
UNIT = st.floats(0, 1, exclude_max=True, width=32)
TOP_P = st.sampled_from([SMALLEST_FLOAT32, 1.0]) | st.floats(SMALLEST_FLOAT32, 1, width=32)  # (0, 1]
TEMPERATURE = st.sampled_from([0.0, 1e-5, 0.5, 1.0, 2.0]) | UNIT  # greedy, at the greedy cut-off, sampled
MIN_P = st.sampled_from([0.0, 1.0]) | UNIT
PENALTY = st.floats(-2, 2, width=32)  # presence and frequency
REPETITION_PENALTY = st.sampled_from([0.01, 1.0, 100.0])
STOP_STRINGS = st.lists(st.text(min_size=1, max_size=3), max_size=3)
CHOICES = st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3)


def stop_ids(vocab: int) -> st.SearchStrategy[list[int]]:
    """Up to 4 stop token ids below ``vocab``."""
    return st.lists(st.integers(0, vocab - 1), max_size=4)


def biases(vocab: int) -> st.SearchStrategy[dict[int, float]]:
    """Logit biases of any ids below ``vocab``, up to +-100."""
    return st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100, width=32), max_size=4)


def set_some(draw: st.DrawFn, fields: dict[str, Callable[[], object]]) -> None:
    """Calls each of ``fields``' setters in about two draws of five (in name order)."""
    for name in sorted(fields):
        if draw(st.integers(0, 4)) < 2:
            fields[name]()


def values_of(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Values of a scalar field's type: any of them, its edges (-1, 0, 1, the least and largest),
    and small ones that validation decides on (ids within the vocabulary, counts near the limits,
    rates in [0, 1]), these more often."""
    kind = field.type
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=16)
    if kind == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=24) | st.sampled_from(["", "user", "system", "{}", '{"type": "object"}', "[a-z]+"])
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        small = st.floats(0, 1, width=32)
        return st.one_of(small, small, small, st.floats(width=32 if kind == FieldDescriptor.TYPE_FLOAT else 64))
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.integers(0, 8)  # unknown values too: a newer client's
    bits = 64 if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT64) else 32
    signed = kind in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64)
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    edges = st.sampled_from(sorted({low, max(low, -1), 0, 1, high}))
    return st.one_of(edges, st.integers(max(low, -2), 12), st.integers(low, high), st.integers(0, 130))


def fill_any(
    draw: Callable[[st.SearchStrategy[Any]], Any], message: Message, depth: int = 0, keep: frozenset[str] = frozenset()
) -> None:
    """Sets up to 4 of ``message``'s fields (the others keep their defaults, so that every check
    is reached), nested messages, lists and maps included; the fields named in ``keep`` are left as
    they are."""
    names = [field.name for field in message.DESCRIPTOR.fields if field.name not in keep]
    for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
        field, held = message.DESCRIPTOR.fields_by_name[name], getattr(message, name)
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            if value.message_type is None:
                held.update(draw(st.dictionaries(values_of(key), values_of(value), max_size=4)))
            elif depth < 3:
                for k in draw(st.lists(values_of(key), max_size=3, unique=True)):
                    held[k].SetInParent()
                    fill_any(draw, held[k], depth + 1)
        elif entry is not None and depth < 3:
            for item in [held.add() for _ in range(draw(st.integers(0, 3)))] if field.is_repeated else [held]:
                item.SetInParent()
                fill_any(draw, item, depth + 1)
        elif entry is None and field.is_repeated:
            held.extend(draw(st.lists(values_of(field), max_size=5)))
        elif entry is None:
            setattr(message, name, draw(values_of(field)))


def within_limits(draw: st.DrawFn, request: coordinator_pb2.GenerateRequest, vocab: int) -> None:
    """Sets any of the sampling and speculation fields to values validation accepts, their
    edges included (a temperature at the greedy cut-off, biases of +-100, every penalty at its
    largest, a stop id or string that ends the reply at once; a structured output without
    ignore_eos or min_tokens), so that the features meet one
    another while the request decodes, not only at the checks; token ids below ``vocab``."""
    s, spec = request.sampling, request.speculation
    fields: dict[str, Callable[[], object]] = {
        "temperature": lambda: setattr(s, "temperature", draw(TEMPERATURE)),
        "top_k": lambda: setattr(s, "top_k", draw(st.integers(0, 300))),
        "top_p": lambda: setattr(s, "top_p", draw(TOP_P)),
        "min_p": lambda: setattr(s, "min_p", draw(MIN_P)),
        "seed": lambda: setattr(s, "seed", draw(st.integers(0, 2**64 - 1))),
        "stop_token_ids": lambda: s.stop_token_ids.extend(draw(stop_ids(vocab))),
        "stop": lambda: s.stop.extend(draw(STOP_STRINGS)),
        "include_stop_str_in_output": lambda: setattr(s, "include_stop_str_in_output", True),
        "ignore_eos": lambda: setattr(s, "ignore_eos", True),
        "logprobs": lambda: (setattr(s, "logprobs", True), setattr(s, "top_logprobs", draw(st.integers(0, 20)))),
        "prompt_logprobs": lambda: setattr(s, "prompt_logprobs", draw(st.integers(0, 20))),
        "min_tokens": lambda: setattr(s, "min_tokens", draw(st.integers(0, s.max_new_tokens))),
        "repetition_penalty": lambda: setattr(s, "repetition_penalty", draw(REPETITION_PENALTY)),
        "presence_penalty": lambda: setattr(s, "presence_penalty", draw(PENALTY)),
        "frequency_penalty": lambda: setattr(s, "frequency_penalty", draw(PENALTY)),
        "logit_bias": lambda: s.logit_bias.update(draw(biases(vocab))),
        "structured_output": lambda: s.structured_output.choice.values.extend(draw(CHOICES)),
        "num_speculative_tokens": lambda: setattr(spec, "num_speculative_tokens", draw(st.integers(0, 8))),
        "disable": lambda: setattr(spec, "disable", True),
        "fixed": lambda: setattr(spec, "fixed", True),
        "method": lambda: setattr(spec, "method", draw(st.integers(0, 3))),
        "draft_confidence": lambda: setattr(spec, "draft_confidence", draw(UNIT)),
        "draft_block_confidence": lambda: setattr(spec, "draft_block_confidence", draw(UNIT)),
    }
    set_some(draw, fields)  # each field in about two requests of five
    if s.HasField("structured_output"):  # it decides where the reply ends: validation refuses these with it
        s.ignore_eos, s.min_tokens = False, 0


# What a lone client's request may be refused with as its own error (NOT_FOUND: it named a session
# that is not there); anything else is the service's failure.
CLIENT_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


@dataclass(frozen=True)
class Sent:
    """How a call ended: OK or its error's code name, and its reply where it was unary and OK."""

    outcome: str
    reply: Any = None


def sent_at_once(
    cluster: LocalCluster,
    calls: Sequence[Callable[[], object]],
    requests: Sequence[object],
    busy_ok: bool = False,
    chats: bool = False,
    state_url: str = "",
    cancels: Sequence[bool] = (),
    greedy: Callable[..., list[int]] | None = None,
    render: Callable[[list[dict[str, str]]], list[int]] | None = None,
) -> list[str]:
    """Makes ``calls`` (each sends its request of ``requests``; a stream is read to its end) at
    once; returns each one's outcome, OK or its refusal's code name. Fails the test where a request
    failed with anything but a client error saying what was wrong (ABORTED also counts as one where
    ``busy_ok``: two of them in one session; CANCELLED where ``cancels`` says its call cancels
    it), where a process of ``cluster`` exited, or where its coordinator counted a draft failure
    meanwhile (a client's request never blames the draft), or where a session one of them named is
    still held once they have all ended: a turn sent to it right after them, as a client that read
    the reply would, must not be refused as busy (a chat turn where ``chats``: the cluster's
    sessions are chats; a session that turn cannot continue, its context full, is closed, so that
    the next example's turns of it are decoded, not refused).

    With ``state_url`` (the Redis the cluster's coordinator keeps its sessions in), also where a
    session is not as its requests left it (``_check_session``) or one they did not name is left
    there (``_check_none_left``), and with ``greedy`` (``greedy_continuation``: the tokens
    target-only greedy decoding gives after a history, but for float near ties) where the next
    turn, greedy, does not give them after the session's stored tokens (a chat's: after its
    stored conversation and the next message, rendered by ``render``, the chat template's tokens):
    what the workers' caches hold for the session must be those tokens, whatever the requests
    before did. A cancelled request must be ``known_by_length``, so that a turn it did not cancel
    in time is known by its length."""
    cancels = list(cancels) or [False] * len(calls)
    assert not any(cancels) or state_url, "a cancelled turn's session is checked in the state store"

    refusals = CLIENT_ERRORS | ({grpc.StatusCode.ABORTED} if busy_ok else set())

    def outcome(
        call: Callable[[], object], request: object, cancel: bool, allowed: frozenset[grpc.StatusCode] = refusals
    ) -> Sent:
        try:
            reply = call()
            if isinstance(reply, Iterable):
                for _ in reply:
                    pass
        except grpc.RpcError as exc:
            if cancel and exc.code() == grpc.StatusCode.CANCELLED:
                return Sent("CANCELLED")
            assert exc.code() in allowed, (exc.code(), exc.details(), request)
            assert exc.details() and "Traceback" not in exc.details()
            return Sent(exc.code().name)
        return Sent("OK", reply)

    named = [r.session_id if isinstance(r, coordinator_pb2.GenerateRequest) else "" for r in requests]
    sessions = set(named) - {""}
    before = {session: find_session(state_url, session) for session in sessions} if state_url else {}
    stored = stored_sessions(state_url) if state_url else set()
    draft_failures = metric(cluster, "coordinator", "specdec_draft_failures_total")
    with ThreadPoolExecutor(len(calls)) as pool:
        outcomes = [sent.outcome for sent in pool.map(outcome, calls, requests, cancels)]
    assert all(process.proc.poll() is None for process in cluster.processes.values()), "a process exited"
    assert metric(cluster, "coordinator", "specdec_draft_failures_total") == draft_failures
    if state_url:
        _check_none_left(state_url, stored | sessions, any(o == "CANCELLED" for o in outcomes))
    after: dict[str, SessionRecord | None] = {}
    for session, was in before.items():
        mine = [(o, r) for o, r, name in zip(outcomes, requests, named, strict=True) if name == session]
        after[session] = _check_session(state_url, session, was, mine, render)
    with grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        for session in sorted(sessions):  # its lease is checked before the turn's contents
            turn = coordinator_pb2.GenerateRequest(session_id=session, require_existing_session=True)
            if chats:
                turn.messages.add(role="user", content="and then?")
            else:
                turn.prompt_token_ids.ids.append(1)
            turn.sampling.max_new_tokens = 1
            record = after.get(session)
            if greedy is not None and record is not None:
                turn.sampling.max_new_tokens, turn.sampling.ignore_eos = 4, True
            following = outcome(functools.partial(stub.Generate, turn, timeout=60), turn, False, CLIENT_ERRORS)
            event(f"next turn {following.outcome}")
            if following.outcome == "OK" and greedy is not None and record is not None:
                if chats:
                    assert render is not None, "a chat's next turn is checked against its rendered conversation"
                    history = render([*json.loads(record.chat or "[]"), {"role": "user", "content": "and then?"}])
                    same = history[: len(record.tokens)] == record.tokens
                    event("next turn keeps the stored tokens" if same else "next turn re-renders the stored tail")
                else:
                    history = [*record.tokens, 1]
                got, expected = list(following.reply.token_ids), greedy(history, 4)
                if got != expected:  # the same tokens where the service's differ by a float near tie
                    expected = greedy(history, 4, got)
                    event("next turn took a float near tie" if got == expected else "next turn differs")
                assert got == expected, (session, record, got, expected, requests)
            if following.outcome not in ("OK", "NOT_FOUND"):  # full (its context): later examples start it anew
                try:
                    stub.CloseSession(coordinator_pb2.CloseSessionRequest(session_id=session), timeout=60)
                except grpc.RpcError as exc:  # a session id the checks refuse
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
    return outcomes


def _check_none_left(state_url: str, kept: set[str], cancelled: bool) -> None:
    """Fails where the state store holds a session besides ``kept`` (those there before and those
    the requests named) once the requests have ended: a one-shot request's session (or one a
    refused request would have made) left behind, to live out its TTL in Redis. A cancelled
    request's goes once the cancel reaches it (10 s at most); the others' by their reply (2 s)."""
    deadline = time.monotonic() + (10 if cancelled else 2)
    while (left := stored_sessions(state_url) - kept) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left, f"sessions left in the state store after their requests ended: {sorted(left)}"


def _check_session(
    state_url: str,
    session: str,
    was: SessionRecord | None,
    turns: list[tuple[str, object]],
    render: Callable[[list[dict[str, str]]], list[int]] | None,
) -> SessionRecord | None:
    """Fails where ``session`` (stored as ``was`` before ``turns``, each an outcome and its
    request) is not as they left it, or still held by one of them (a cancelled one: 10 s after it
    was cancelled); returns it as it is now (None: no such session). Refused turns are rolled back
    whole: the tokens and conversation as they were (a session they would have made is not there).
    A cancelled turn is rolled back too, unless it had finished before the cancel reached it: the
    tokens then end in its prompt (a chat's: the conversation with its messages, rendered by
    ``render``) and exactly its ``max_new_tokens``, and a chat's conversation in its messages and
    the reply. A served turn of a prompt session appends to its tokens (a chat's may re-render
    its tail)."""
    now = find_session(state_url, session)
    # a cancelled turn rolls back once the cancel reaches it; the others have let go by their reply
    deadline = time.monotonic() + (10 if any(o == "CANCELLED" for o, _ in turns) else 0)
    while now is not None and now.owner and time.monotonic() < deadline:
        time.sleep(0.02)
        now = find_session(state_url, session)
    assert now is None or not now.owner, (session, now, turns)
    old, new = (was.tokens, was.chat) if was else None, (now.tokens, now.chat) if now else None
    if any(o == "OK" for o, _ in turns):
        if was is not None and not was.chat and now is not None:
            assert now.tokens[: len(was.tokens)] == was.tokens, (session, was, now, turns)
        return now
    finished_anyway = [_finished(request, was, render) for o, request in turns if o == "CANCELLED"]
    if new == old:
        kind = "new" if was is None else "existing"
        event(f"a session its turns left as it was ({kind}, {len(finished_anyway)} cancelled)")
    else:
        assert now is not None and any(
            now.tokens[: len(begins)] == begins
            and len(now.tokens) == len(begins) + length
            and (chat is None or _without_reply(now.chat) == chat)
            for begins, length, chat in finished_anyway
        ), (session, was, now, turns)
        event("a cancelled turn that had finished")
    return now


def _finished(
    request: object, was: SessionRecord | None, render: Callable[[list[dict[str, str]]], list[int]] | None
) -> tuple[list[int], int, list[dict[str, str]] | None]:
    """What a cancelled ``request`` (``known_by_length``) leaves where it had finished before the
    cancel reached it: the tokens its reply follows, the reply's length, and a chat's
    conversation before the reply (None: a prompt turn)."""
    assert isinstance(request, coordinator_pb2.GenerateRequest)
    s = request.sampling
    assert s.ignore_eos and not (s.stop or s.stop_token_ids or s.HasField("structured_output"))
    if request.messages:
        assert render is not None, "a cancelled chat turn's prompt is its rendered conversation"
        said = [{"role": message.role, "content": message.content} for message in request.messages]
        chat = [*json.loads(was.chat if was and was.chat else "[]"), *said]
        return render(chat), s.max_new_tokens, chat
    assert request.prompt_token_ids.ids
    return [*(was.tokens if was else []), *request.prompt_token_ids.ids], s.max_new_tokens, None


def _without_reply(chat: str) -> list[dict[str, str]] | None:
    """A stored conversation less its last message where that is the assistant's reply."""
    messages = json.loads(chat) if chat else []
    return messages[:-1] if messages and messages[-1]["role"] == "assistant" else None


def known_by_length(draw: st.DrawFn, request: coordinator_pb2.GenerateRequest) -> None:
    """Makes ``request`` one whose turn is known by its length where a cancel comes too late:
    8-40 new tokens, end-of-sequence ignored, no stop or constraint (its prompt and other features
    stay as drawn)."""
    s = request.sampling
    s.max_new_tokens, s.ignore_eos = draw(st.integers(8, 40)), True
    del s.stop[:], s.stop_token_ids[:]
    s.ClearField("structured_output")


def cancelled_after_its_first_round(stream: Callable[..., Iterator[Any]], request: Message) -> Iterator[Any]:
    """Streams ``request`` with ``stream`` (a server-streaming method) and cancels it once its
    first reply came, its first round's tokens (as a client that disconnects); the rest of the
    stream ends CANCELLED, or as it was where it had ended."""
    call = stream(request, timeout=60)
    next(call, None)  # the refusal, if it was refused, comes out here
    call.cancel()
    return call


def streamed(
    stream: Callable[..., Iterator[Any]], requests: Sequence[Message], cancels: Sequence[bool]
) -> list[Callable[[], object]]:
    """A call per request for ``sent_at_once``: each streams its request with ``stream`` (a
    server-streaming method), cancelled after its first reply where ``cancels`` says so."""
    return [
        functools.partial(cancelled_after_its_first_round, stream, request)
        if cancel
        else functools.partial(stream, request, timeout=60)
        for request, cancel in zip(requests, cancels, strict=True)
    ]


def shares_a_session(requests: Sequence[coordinator_pb2.GenerateRequest]) -> bool:
    """Whether two of ``requests`` name the same session (sent at once, one may be refused as busy)."""
    sessions = [request.session_id for request in requests if request.session_id]
    return len(sessions) > len(set(sessions))
