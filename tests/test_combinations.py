"""Request features combined at random, through the real service (three processes): every greedy
reply, whatever mix of stop strings, stop ids, min_tokens, penalties, logit bias, logprobs, prompt
logprobs, structured output, drafting method, K, confidence stops, multi-turn sessions and
unary or stream calls it asks for, equals the same request decoded target-only by the same
service (speculation disabled; that path is itself checked against HF ``generate`` feature by
feature in test_features.py and test_e2e.py). A request one path refuses, the other refuses with
the same status and message; no request ends in any other status than OK or INVALID_ARGUMENT.
Sampled requests of the same mixes must also end OK or INVALID_ARGUMENT. Planted in the
coordinator by hand, a stop token that comes first in a block of several not ending the reply
failed 2 of the 6 cases.

Sampled mixes are checked for their distribution too (MIXES): three requests of several
features at once, each sent 1,500 times with other seeds through the whole service, whose first
three tokens must follow the exact distribution of the target alone with the same processing
(enumerated with plain forward passes and the independent references of tests/spec_oracle.py;
chi-square p > PASS_P), and must reject the distribution a planted bug would give (the power
check). Planted in the services by hand, each failed its mix: the residual after a rejection
drawn from p (the session mix at p = 6e-5, the lookup mix at p = 3e-66; the draft that is always
right is rarely rejected), penalties and min_tokens counted from the session's start, and a stop
string found only at a round's last token (both: sequences the target cannot give)."""

from __future__ import annotations

import collections
import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc
import pytest
from google.protobuf import json_format

from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.reference import SAMPLED_AT_ONCE, coordinator_stub, reference_greedy
from tests.spec_oracle import PASS_P, Enumerator, chi_square_pvalue, rejects
from tests.tiny_models import TinyModels, build_tokenizer

CASES = 30  # per cluster and seed: 12-21 s a case on the 2-core host
PIECES = [
    "def",
    " add",
    "(a, b)",
    ":",
    "\n",
    "    return",
    " a + b",
    "x",
    "hello",
    " world",
    "ab",
    "aaa",
    "{",
    '"',
    "é",
]
VOCAB = 259  # the tiny models' byte tokenizer
GRAMMAR = 'root ::= "x" [0-9]+ ("," [0-9]+)* "."'  # GBNF
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


TOLERANCE = 1e-4  # logprobs of one position from passes of other shapes differ in float rounding

Entry = tuple[int, float | None, tuple[tuple[int, float], ...]]  # token, logprob (None: unset), top


@dataclass(frozen=True)
class Reply:
    """What a call gave: its status and, when OK, everything a client reads of the reply."""

    status: str
    details: str = ""
    tokens: tuple[int, ...] = ()
    text: str = ""
    finish: int = 0
    logprobs: tuple[Entry, ...] = ()
    prompt_logprobs: tuple[Entry, ...] = ()

    def agrees(self, other: Reply) -> bool:
        """Equal, logprobs within TOLERANCE (and top alternatives in either order where their
        logprobs are that close)."""
        bare = {"logprobs": (), "prompt_logprobs": ()}
        return (
            replace(self, **bare) == replace(other, **bare)
            and _entries_agree(self.logprobs, other.logprobs)
            and _entries_agree(self.prompt_logprobs, other.prompt_logprobs)
        )


def _entries_agree(ours: tuple[Entry, ...], theirs: tuple[Entry, ...]) -> bool:
    return len(ours) == len(theirs) and all(
        a[0] == b[0] and _close(a[1], b[1]) and _tops_agree(a[2], b[2]) for a, b in zip(ours, theirs, strict=True)
    )


def _close(ours: float | None, theirs: float | None) -> bool:
    return ours == theirs or (ours is not None and theirs is not None and abs(ours - theirs) <= TOLERANCE)


def _tops_agree(ours: tuple[tuple[int, float], ...], theirs: tuple[tuple[int, float], ...]) -> bool:
    """The same logprobs in order, and the same tokens but where a tie (within TOLERANCE) with
    another or with the one left out may have ordered them otherwise: a token tied in either
    list is left out of both (each list's own values decide, which differ by rounding)."""
    if len(ours) != len(theirs) or any(abs(a[1] - b[1]) > TOLERANCE for a, b in zip(ours, theirs, strict=True)):
        return False
    tied = {token for top in (ours, theirs) for token, value in top if not _clear(top, token, value)}
    return [t for t, _ in ours if t not in tied] == [t for t, _ in theirs if t not in tied]


def _clear(top: tuple[tuple[int, float], ...], token: int, value: float) -> bool:
    """Above the list's last value (a token left out could tie it) and apart from every other."""
    return value > top[-1][1] + 2 * TOLERANCE and all(abs(value - v) > 2 * TOLERANCE for t, v in top if t != token)


def _entry(e: common_pb2.TokenLogprob) -> Entry:
    logprob = e.logprob if e.HasField("logprob") else None
    return (e.token_id, logprob, tuple((t.token_id, t.logprob) for t in e.top))


def call(stub: coordinator_pb2_grpc.GenerationStub, request: coordinator_pb2.GenerateRequest, stream: bool) -> Reply:
    try:
        if stream:
            messages = list(stub.GenerateStream(request, timeout=120))
            return Reply(
                "OK",
                tokens=tuple(t for m in messages for t in m.token_ids),
                text="".join(m.text for m in messages),
                finish=messages[-1].finish_reason,
                logprobs=tuple(_entry(e) for m in messages for e in m.logprobs),
                prompt_logprobs=tuple(_entry(e) for m in messages for e in m.prompt_logprobs),
            )
        reply = stub.Generate(request, timeout=120)
        return Reply(
            "OK",
            tokens=tuple(reply.token_ids),
            text=reply.text,
            finish=reply.finish_reason,
            logprobs=tuple(_entry(e) for e in reply.logprobs),
            prompt_logprobs=tuple(_entry(e) for e in reply.prompt_logprobs),
        )
    except grpc.RpcError as error:
        return Reply(error.code().name, error.details() or "")


def _text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(pieces))


def random_sampling(rng: random.Random, greedy: bool) -> common_pb2.SamplingParams:
    """A mix of the request's sampling features, each present with some chance."""
    s = common_pb2.SamplingParams()
    if rng.random() < 0.8:
        s.max_new_tokens = rng.choice([1, 2, 5, 17, 40])
    if not greedy:
        s.temperature = rng.choice([0.5, 1.0, 1.5])
        if rng.random() < 0.4:
            s.top_k = rng.choice([1, 5, 50])
        if rng.random() < 0.4:
            s.top_p = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            s.min_p = rng.choice([0.05, 0.5])
        s.seed = rng.randrange(2**32)
    if rng.random() < 0.3:
        s.ignore_eos = True
    if rng.random() < 0.3:
        s.stop_token_ids.extend(rng.sample(range(VOCAB), rng.randint(1, 3)))
    if rng.random() < 0.4:
        s.stop.extend(_text(rng, 1)[: rng.randint(1, 3)] for _ in range(rng.randint(1, 3)))
        s.include_stop_str_in_output = rng.random() < 0.5
    if rng.random() < 0.3:
        s.logprobs = True
        s.top_logprobs = rng.choice([0, 1, 5])
    if rng.random() < 0.2:
        s.prompt_logprobs = rng.choice([0, 2])
    if rng.random() < 0.3:
        s.min_tokens = rng.choice([1, 3, 10])
    if rng.random() < 0.3:
        s.repetition_penalty = rng.choice([0.7, 1.3, 2.0])
    if rng.random() < 0.3:
        s.presence_penalty = rng.choice([-1.0, 0.5, 2.0])
    if rng.random() < 0.3:
        s.frequency_penalty = rng.choice([-1.0, 0.5, 2.0])
    if rng.random() < 0.3:
        for _ in range(rng.randint(1, 4)):
            s.logit_bias[rng.randrange(VOCAB)] = rng.choice([-100.0, -5.0, 3.0, 100.0])
    constraint = rng.random()
    if constraint < 0.05:
        s.structured_output.regex = rng.choice(["[ab]+", "(a|b)c*d", "[0-9]{2,4}"])
    elif constraint < 0.08:
        s.structured_output.json_object = True
    elif constraint < 0.11:
        s.structured_output.choice.values.extend(["yes", "no", "maybe"])
    elif constraint < 0.14:
        s.structured_output.json_schema = SCHEMA
    elif constraint < 0.16:
        s.structured_output.grammar = GRAMMAR
    return s


def random_speculation(rng: random.Random) -> coordinator_pb2.SpeculationParams:
    p = coordinator_pb2.SpeculationParams()
    if rng.random() < 0.6:
        p.num_speculative_tokens = rng.choice([1, 2, 4, 8])
    if rng.random() < 0.3:
        p.fixed = True
    if rng.random() < 0.5:
        p.method = rng.choice(
            [
                coordinator_pb2.DRAFT_METHOD_MODEL,
                coordinator_pb2.DRAFT_METHOD_NGRAM,
                coordinator_pb2.DRAFT_METHOD_HYBRID,
            ]
        )
    if rng.random() < 0.2:
        p.draft_confidence = rng.choice([0.0, 0.3, 0.9])
    if rng.random() < 0.1:
        p.draft_block_confidence = rng.choice([0.0, 0.5])
    return p


def random_request(rng: random.Random, greedy: bool, session_id: str = "") -> coordinator_pb2.GenerateRequest:
    request = coordinator_pb2.GenerateRequest(
        session_id=session_id, sampling=random_sampling(rng, greedy), speculation=random_speculation(rng)
    )
    if rng.random() < 0.5:
        request.prompt = _text(rng, rng.randint(1, 10))
    else:
        request.prompt_token_ids.ids.extend(rng.randrange(VOCAB) for _ in range(rng.randint(1, 25)))
    return request


def target_only(request: coordinator_pb2.GenerateRequest) -> coordinator_pb2.GenerateRequest:
    """The same request with speculation disabled (and its own session, when it has one)."""
    reference = coordinator_pb2.GenerateRequest()
    reference.CopyFrom(request)
    if reference.session_id:
        reference.session_id = f"target-only-{reference.session_id}"
    reference.speculation.Clear()
    reference.speculation.disable = True
    return reference


@pytest.fixture(params=["pipelined", "same", "other"])
def stub(request: pytest.FixtureRequest) -> Iterator[coordinator_pb2_grpc.GenerationStub]:
    """A sometimes-right draft in pipelined mode; a draft that is always right (stops met inside
    accepted blocks); an unrelated draft with the sessions in a real redis-server."""
    yield from coordinator_stub(request.getfixturevalue(f"cluster_{request.param}"))


def decode_random_mixes(
    stub: coordinator_pb2_grpc.GenerationStub, rng: random.Random, cases: int, name: str
) -> dict[str, int]:
    """``cases`` random mixes (a quarter sampled, a quarter sessions of 2-3 turns named after
    ``name``, each call unary or a stream): every call ends OK or INVALID_ARGUMENT, and each
    greedy reply equals the same request decoded with speculation disabled. Returns how many calls
    ended with each status."""
    seen: dict[str, int] = {}
    for case in range(cases):
        greedy = rng.random() < 0.75
        session = f"{name}-{case}" if rng.random() < 0.25 else ""
        turns = [random_request(rng, greedy, session) for _ in range(rng.randint(2, 3) if session else 1)]
        for turn, asked in enumerate(turns):
            got = call(stub, asked, stream=rng.random() < 0.5)
            seen[got.status] = seen.get(got.status, 0) + 1
            assert got.status in ("OK", "INVALID_ARGUMENT"), (case, turn, asked, got)
            if greedy:
                expected = call(stub, target_only(asked), stream=False)
                assert got.agrees(expected), (case, turn, asked, got, expected)
    return seen


@pytest.mark.parametrize("seed", [1, 2])
def test_random_feature_mixes_decode_as_the_target_alone(
    stub: coordinator_pb2_grpc.GenerationStub, seed: int, request: pytest.FixtureRequest
) -> None:
    case_id = request.node.callspec.id  # cluster and seed: each case its own mixes
    seen = decode_random_mixes(stub, random.Random(case_id), CASES, f"mix-{case_id}")
    assert seen.get("OK", 0) >= CASES, seen  # most mixes are valid: the comparison is not vacuous


# Sampled mixes: their distribution through the whole service, against an exact enumeration.

SAMPLES = 1500  # requests per mix, SAMPLED_AT_ONCE at a time
FIRST = 3  # tokens whose joint distribution is tested (fewer where the reply ends sooner)
MAX_NEW = 8  # each reply's budget: rounds past the tested tokens are drafted ahead too
FIRST_TURN = 4  # the greedy first turn's tokens, where a mix has a history
BYTES = build_tokenizer()  # the tiny models' tokenizer


@dataclass(frozen=True)
class SampledMix:
    """A sampled request of several features at once on one of the clusters. With ``history``
    the request is the second turn of a session whose first turn sent ``history`` and was greedy,
    so the penalties and the lookup see the history. ``stop``: "favourite id" adds the target's
    favourite first token to the stop ids (min_tokens bans it); "likely char" adds a stop string,
    the character most likely to come second or third. ``bug``: the planted bug the power check
    plants in the enumeration (see Enumerator)."""

    cluster: str
    prompt: tuple[int, ...]
    sampling: dict[str, object]
    speculation: dict[str, object]
    bug: str
    shown: tuple[str, ...]  # what the replies' stats must show happened (Sampled's fields), besides accepted drafts
    history: tuple[int, ...] = ()
    stop: str = ""


MIXES = {
    # pipelined, the default hybrid drafting with adaptive K; penalties over a session's history,
    # logit bias, min_tokens banning a stop id, min_p (the prompt repeats the history: lookups match)
    "session-penalties-hybrid": SampledMix(
        "pipelined",
        prompt=(122, 24, 157, 91),
        history=(122, 24, 157, 91, 36, 154, 206),
        sampling={
            "temperature": 0.9,
            "top_k": 4,
            "min_p": 0.1,
            "repetition_penalty": 1.8,
            "presence_penalty": -2.0,
            "frequency_penalty": 0.5,
            "logit_bias": "favourites",
            "min_tokens": 2,
            "ignore_eos": True,
        },
        speculation={},
        bug="min_tokens counts the history",
        shown=("lookup_rounds", "pipelined_rounds"),
        stop="favourite id",
    ),
    # lookup drafts only (one-hot proposals, right some of the time), fixed K = 4, a regex whose
    # next character depends on the ones before; top_p; logprobs asked for; sessions in Redis
    "regex-ngram-top-p": SampledMix(
        "other",
        prompt=tuple(BYTES.encode("x= abx, y= ba1, z= ")),
        sampling={
            "temperature": 1.2,
            "top_p": 0.95,
            "logprobs": True,
            "top_logprobs": 2,
            "logit_bias": {BYTES.encode("a")[0]: -1.5, BYTES.encode("c")[0]: 1.0},
            "structured_output": {"regex": r"(ab|ba|cc)x|[a-c][0-9]"},
        },
        speculation={"method": coordinator_pb2.DRAFT_METHOD_NGRAM, "num_speculative_tokens": 4, "fixed": True},
        bug="the mask ignores the reply",
        shown=("lookup_rounds",),
    ),
    # a draft always right (blocks of up to 8, ended by the block stop) and a stop string met inside
    # accepted blocks; a repetition penalty below 1, a negative presence penalty, a -100 bias
    "stop-string-model-draft": SampledMix(
        "same",
        prompt=(9, 200, 31, 77, 9, 200),
        sampling={
            "temperature": 1.3,
            "top_k": 5,
            "repetition_penalty": 0.7,
            "presence_penalty": -2.0,
            "frequency_penalty": -1.0,
            "logit_bias": "favourites",
            "include_stop_str_in_output": True,
        },
        speculation={
            "method": coordinator_pb2.DRAFT_METHOD_MODEL,
            "num_speculative_tokens": 8,
            "draft_block_confidence": 0.5,
        },
        bug="stop strings ignored",
        shown=("stop_strings",),
        stop="likely char",
    ),
}


def sampled_request(mix: SampledMix, seed: int, session_id: str = "") -> coordinator_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, seed=seed)
    json_format.ParseDict({k: v for k, v in mix.sampling.items() if k != "logit_bias"}, sampling)
    sampling.logit_bias.update(mix.sampling.get("logit_bias", {}))  # type: ignore[call-overload]
    request = coordinator_pb2.GenerateRequest(
        session_id=session_id, sampling=sampling, speculation=coordinator_pb2.SpeculationParams(**mix.speculation)
    )
    request.prompt_token_ids.ids.extend(mix.prompt)
    return request


@dataclass
class Sampled:
    """What a mix's requests gave: the first FIRST tokens of each reply, counted, and what
    speculation did (summed over the replies)."""

    counts: collections.Counter[tuple[int, ...]]
    accepted: int = 0  # draft tokens, model and lookup
    lookup_rounds: int = 0
    pipelined_rounds: int = 0
    stop_strings: int = 0  # replies a stop string ended


def sample_mix(
    stub: coordinator_pb2_grpc.GenerationStub, mix: SampledMix, name: str
) -> tuple[Sampled, tuple[int, ...]]:
    """SAMPLES requests of ``mix`` (seed = request number), SAMPLED_AT_ONCE at a time; with a
    history each is the second turn of a session of its own. Also the context the replies followed."""
    first_turns: set[tuple[int, ...]] = set()

    def one(seed: int) -> coordinator_pb2.GenerateResponse:
        session = f"sampled-{name}-{seed}" if mix.history else ""
        if mix.history:
            turn = coordinator_pb2.GenerateRequest(
                session_id=session,
                sampling=common_pb2.SamplingParams(max_new_tokens=FIRST_TURN, temperature=0.0, ignore_eos=True),
            )
            turn.prompt_token_ids.ids.extend(mix.history)
            first_turns.add((*mix.history, *stub.Generate(turn, timeout=60).token_ids))
        reply = stub.Generate(sampled_request(mix, seed, session), timeout=60)
        if session:
            stub.CloseSession(coordinator_pb2.CloseSessionRequest(session_id=session), timeout=60)
        return reply

    with ThreadPoolExecutor(SAMPLED_AT_ONCE) as pool:  # several at once, as clients send them: the workers batch them
        replies = list(pool.map(one, range(SAMPLES)))
    assert len(first_turns) <= 1, first_turns  # greedy: every session has the same history
    sampled = Sampled(collections.Counter(tuple(reply.token_ids[:FIRST]) for reply in replies))
    for reply in replies:
        sampled.accepted += reply.stats.draft_tokens_accepted
        sampled.lookup_rounds += reply.stats.lookup_rounds
        sampled.pipelined_rounds += reply.stats.pipelined_rounds
        sampled.stop_strings += reply.HasField("stop_string")
    return sampled, (*first_turns.pop(), *mix.prompt) if first_turns else mix.prompt


def prepared(mix: SampledMix, enumerator: Enumerator) -> tuple[SampledMix, tuple[int, ...]]:
    """The mix with the values that depend on the target filled in, and the context its replies
    follow (with a history: the history, the target's greedy first turn, the prompt)."""
    first_turn = reference_greedy(enumerator.model_dir, mix.history, FIRST_TURN, ignore_eos=True) if mix.history else []
    context = (*mix.history, *first_turn, *mix.prompt)
    if mix.sampling.get("logit_bias") == "favourites":
        mix = replace(mix, sampling={**mix.sampling, "logit_bias": enumerator.favourite_bias(context)})
    if mix.stop == "favourite id":
        (favourite,) = reference_greedy(enumerator.model_dir, context, 1, ignore_eos=True)
        mix = replace(mix, sampling={**mix.sampling, "stop_token_ids": [favourite]})
    elif mix.stop == "likely char":
        plain = enumerator.distribution(context, sampled_request(mix, 0).sampling)
        mix = replace(mix, sampling={**mix.sampling, "stop": [enumerator.likely_char(plain)]})
    return mix, context


@pytest.fixture(scope="module")
def enumerator(tiny_models: TinyModels) -> Enumerator:
    return Enumerator(str(tiny_models.target), FIRST)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MIXES))
def test_sampled_feature_mixes_follow_the_exact_distribution(
    name: str, enumerator: Enumerator, request: pytest.FixtureRequest
) -> None:
    """SAMPLES seeded requests of a mix through the whole service: their first tokens follow the
    exact distribution of the target with the mix's processing (chi-square, p > PASS_P), and the
    same samples reject the distribution of the mix's planted bug (the power check)."""
    mix, context = prepared(MIXES[name], enumerator)
    cluster = request.getfixturevalue(f"cluster_{mix.cluster}")
    with grpc.insecure_channel(cluster.address) as channel:
        sampled, sent = sample_mix(coordinator_pb2_grpc.GenerationStub(channel), mix, name)
    assert sent == context  # the first turns gave the target's greedy tokens
    sampling = sampled_request(mix, 0).sampling
    assert sampled.accepted > 0 and all(getattr(sampled, field) > 0 for field in mix.shown), sampled
    assert chi_square_pvalue(sampled.counts, enumerator.distribution(context, sampling), SAMPLES) > PASS_P
    assert rejects(sampled.counts, enumerator.distribution(context, sampling, mix.bug))
