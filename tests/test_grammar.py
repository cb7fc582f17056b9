"""Structured output (specdec.runtime.grammar): constraints checked into grammars, and the row
masks of a verify pass, kept between calls with a session's cache, against a fresh matcher per row."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import threading
import time

import grpc
import pytest
import torch
from llguidance import LLMatcher
from prometheus_client import CollectorRegistry
from transformers import PreTrainedTokenizer, PreTrainedTokenizerBase

from coordinator.validation import Limits, parse_request
from specdec.runtime.grammar import MAX_GRAMMAR_CHARS, GrammarMasks, GrammarState, _checked, constrain, grammar_of
from specdec.serving.errors import GrammarsUnavailable, InvalidRequest
from specdec.state.base import CacheLocation
from specdec.v1 import common_pb2, coordinator_pb2
from tests.fakes import FakeTarget, FakeTargets
from tests.helpers import real_tokenizer
from tests.tiny_models import build_tokenizer

SO = common_pb2.StructuredOutput
EOS = 257  # the byte tokenizer's </s>


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return build_tokenizer()


@pytest.fixture(scope="module")
def masks(tokenizer: PreTrainedTokenizerBase) -> GrammarMasks:
    built = GrammarMasks.build(tokenizer, len(tokenizer), [EOS])
    assert built is not None
    return built


def ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def allowed(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (SO(json_schema="{"), "structured_output.json_schema is not valid JSON"),
        (SO(json_schema="[1, 2]"), "must be a JSON object"),
        (SO(json_schema=" "), "structured_output.json_schema is empty"),
        (SO(json_object=False), "must be true when set"),
        (SO(regex="a(b"), "structured_output.regex is not valid: "),
        (SO(regex="a" * (MAX_GRAMMAR_CHARS + 1)), f"at most {MAX_GRAMMAR_CHARS} are allowed"),
        (SO(grammar="start: foo"), "structured_output.grammar is not valid: "),
        (SO(grammar='root ::= "a" missing'), "structured_output.grammar is not valid: "),
        (SO(choice=common_pb2.Choices(values=[])), "needs 1 to 1024 non-empty strings"),
        (SO(choice=common_pb2.Choices(values=["a", ""])), "needs 1 to 1024 non-empty strings"),
        (SO(choice=common_pb2.Choices(values=["x"] * 1025)), "needs 1 to 1024 non-empty strings"),
    ],
)
def test_a_bad_constraint_says_what_is_wrong(constraint: common_pb2.StructuredOutput, message: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        grammar_of(constraint)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_every_kind_of_constraint_gives_its_language(masks: GrammarMasks, tokenizer: PreTrainedTokenizerBase) -> None:
    """Each kind compiles, and a matcher of its grammar takes a string of the language to the end."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    cases = [
        (SO(json_schema=json.dumps(schema)), '{"n": 42}', '{"m": 1}'),
        (SO(json_object=True), '{"any": [1, "x"]}', "[1]"),
        (SO(regex=r"[a-c]+-[0-9]{2}"), "abc-12", "abc-1x"),
        (SO(grammar='root ::= "x" [0-9]+ ("," [0-9]+)*'), "x1,23", "x1,,2"),  # GBNF
        (SO(grammar='start: "x" NUM ("," NUM)*\nNUM: /[0-9]+/'), "x1,23", "x,1"),  # Lark
        (SO(choice=common_pb2.Choices(values=["yes", "no", "maybe so"])), "maybe so", "maybe"),
    ]
    for constraint, good, bad in cases:
        grammar = grammar_of(constraint)
        matcher = masks.matcher(grammar)
        assert matcher.consume_tokens([*ids(tokenizer, good), EOS]), (good, matcher.get_error())
        assert masks.matcher(grammar).validate_tokens([*ids(tokenizer, bad), EOS]) < len(bad) + 1, bad
    assert grammar_of(SO()) == ""


def test_the_rows_of_a_pass_are_masked_with_the_drafts_before_them(
    masks: GrammarMasks, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Row r is masked by the state after the reply's tokens before it; rows after a draft the
    grammar does not allow, or after the end-of-sequence token, are left as they are."""
    grammar = grammar_of(SO(regex=r"(ab|ba)x|c[0-9]"))
    prompt = ids(tokenizer, "P:")
    a, b, c, x, zero = (ids(tokenizer, ch)[0] for ch in "abcx0")
    logits = torch.zeros(4, len(tokenizer))
    state = GrammarState(masks)
    out = state.masked(logits, [*prompt, a, b, x], len(prompt), grammar, len(prompt))
    assert out is not None
    assert [allowed(row) for row in out] == [{a, b, c}, {b}, {x}, {EOS}]
    digits = set(ids(tokenizer, "0123456789"))
    out = state.masked(logits, [*prompt, c, a, x], len(prompt), grammar, len(prompt))  # "a" breaks the grammar
    assert out is not None
    assert [allowed(row) for row in out] == [{a, b, c}, digits, set(range(len(tokenizer))), set(range(len(tokenizer)))]
    out = state.masked(logits[:3], [*prompt, c, zero, EOS], len(prompt), grammar, len(prompt))
    assert out is not None
    assert [allowed(row) for row in out] == [{a, b, c}, digits, {EOS}]
    assert torch.equal(logits, torch.zeros(4, len(tokenizer)))  # the caller's logits are left as they were


def test_the_kept_matcher_follows_the_cache_and_equals_a_fresh_one_per_row(
    masks: GrammarMasks, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Calls as a session makes them (the cache grows, is cut back to what was accepted, a new
    turn starts its reply later): each row's mask equals that of a fresh matcher fed the reply
    before the row."""
    grammar = grammar_of(SO(regex=r"([a-c][0-9])+;"))
    state, rng = GrammarState(masks), random.Random(7)
    letters, digits = ids(tokenizer, "abc"), ids(tokenizer, "0123456789")
    tokens, reply_start = ids(tokenizer, "P:"), 2
    checked = 0
    for _ in range(60):
        committed = len(tokens)
        drafts = [rng.choice(letters if (len(tokens) + i - reply_start) % 2 == 0 else digits) for i in range(3)]
        if rng.random() < 0.2:
            drafts[rng.randrange(3)] = ids(tokenizer, "z")[0]  # a draft the grammar does not allow
        rows = len(drafts) + 1
        out = state.masked(torch.zeros(rows, len(tokenizer)), [*tokens, *drafts], committed, grammar, reply_start)
        assert out is not None
        history = [*tokens, *drafts]
        for r in range(rows):
            fresh = masks.matcher(grammar)
            if fresh.validate_tokens(history[reply_start : committed + r]) < committed + r - reply_start:
                break  # a draft before this row broke the grammar: the row decides nothing
            assert fresh.consume_tokens(history[reply_start : committed + r])
            bits = fresh.compute_bitmask()
            expected = {i for i in range(len(tokenizer)) if bits[i // 8] >> (i % 8) & 1}
            assert allowed(out[r]) == expected
            checked += 1
        accepted = next((i for i, t in enumerate(drafts) if allowed(out[i]) != set() and t not in allowed(out[i])), 3)
        tokens += drafts[: rng.randint(0, accepted)]  # the target keeps some of the allowed drafts
        if rng.random() < 0.1:  # a new turn: its reply starts here
            tokens += ids(tokenizer, ";")
            reply_start = len(tokens)
    assert checked > 150


def test_strict_and_lenient_callers(masks: GrammarMasks, tokenizer: PreTrainedTokenizerBase) -> None:
    """A reply that already breaks the grammar, or a worker without grammar masks: the target's
    request fails saying so; the draft drafts unmasked (only its acceptance is at stake)."""
    grammar = grammar_of(SO(regex="ab"))
    broken = ids(tokenizer, "P:zz")
    logits = torch.randn(1, len(tokenizer))
    for state, error in ((GrammarState(masks), InvalidRequest), (None, GrammarsUnavailable)):
        with pytest.raises(error):  # a worker without masks: UNIMPLEMENTED (the coordinator tries another)
            constrain(logits, state, broken, len(broken), grammar, 2, strict=True)
        assert constrain(logits, state, broken, len(broken), grammar, 2, strict=False) is logits
    assert constrain(logits, None, broken, len(broken), "", 2, strict=True) is logits


class _PythonTokenizer(PreTrainedTokenizer):
    """A tokenizer written in Python (transformers' python backend), as some remote-code models ship."""

    def __init__(self, **kwargs: object) -> None:
        self._ids = {"a": 0, "b": 1, "</s>": 2}
        super().__init__(eos_token="</s>", **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._ids)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._ids)

    def _tokenize(self, text: str, **kwargs: object) -> list[str]:
        return list(text)

    def _convert_token_to_id(self, token: str) -> int:
        return self._ids.get(token, 0)

    def _convert_id_to_token(self, index: int) -> str:
        return next(t for t, i in self._ids.items() if i == index)


def test_a_python_tokenizer_gives_no_masks() -> None:
    """llguidance reads tokenizers of the Rust backend only: a model with one written in Python
    serves without structured output (its Info says so), as does one without end-of-sequence ids."""
    assert GrammarMasks.build(_PythonTokenizer(), 3, [2]) is None
    assert GrammarMasks.build(build_tokenizer(), 259, []) is None


def test_compiled_grammars_are_kept_up_to_a_bound(masks: GrammarMasks) -> None:
    for n in range(80):
        masks.matcher(LLMatcher.grammar_from_regex(f"a{{{n + 1}}}"))
    assert len(masks._templates) == 64


def test_the_coordinator_refuses_what_it_cannot_honour() -> None:
    limits = Limits(
        vocab_size=300,
        max_context_len=64,
        eos_token_ids=frozenset({EOS}),
        default_max_new_tokens=16,
        default_k=4,
        max_k=8,
        max_prompt_chars=1000,
        structured_output=True,
    )

    def request(**sampling: object) -> coordinator_pb2.GenerateRequest:
        params = common_pb2.SamplingParams(structured_output=SO(json_object=True), **sampling)  # type: ignore[arg-type]
        return coordinator_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[1, 2]), sampling=params)

    assert parse_request(request(), limits).processing.grammar == grammar_of(SO(json_object=True))
    with pytest.raises(InvalidRequest, match="needs target workers that apply grammars"):
        parse_request(request(), dataclasses.replace(limits, structured_output=False))
    with pytest.raises(InvalidRequest, match="cannot be combined with ignore_eos"):
        parse_request(request(ignore_eos=True), limits)
    with pytest.raises(InvalidRequest, match="cannot be combined with min_tokens"):
        parse_request(request(min_tokens=1, max_new_tokens=4), limits)


def test_a_grammar_past_its_work_limits_fails_the_request_saying_so(
    masks: GrammarMasks, tokenizer: PreTrainedTokenizerBase
) -> None:
    """A schema whose parse outgrows llguidance's per-step limits: the request fails with the
    reason (target and draft alike), not as a reply that broke the grammar; the compiled grammar
    is kept for the next request, and a compile done before the job is found there."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    grammar = grammar_of(SO(json_schema=json.dumps(schema)))
    masks.compile(grammar)
    assert masks.holds(grammar)
    reply = ids(tokenizer, 'P:{"p1')
    for strict in (True, False):
        with pytest.raises(InvalidRequest, match=r"the structured-output constraint failed: .*max is 2000"):
            constrain(torch.zeros(1, len(tokenizer)), GrammarState(masks), reply, len(reply), grammar, 2, strict=strict)


def test_the_llguidance_tokenizer_is_built_with_the_model(tokenizer: PreTrainedTokenizerBase) -> None:
    """The tokenizer llguidance reads is built once, when the model loads (see the next test for
    why), and every grammar compiles with it."""
    masks = GrammarMasks.build(tokenizer, len(tokenizer), [EOS])
    assert masks is not None and not masks.failed
    built = masks.tokenizer
    masks.compile(grammar_of(SO(regex="ab")))
    masks.compile(grammar_of(SO(regex="cd")))
    assert masks.tokenizer is built


def test_the_first_grammar_does_not_hold_up_the_worker_s_other_threads(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A worker compiles a request's grammar on a thread of its own while its event loop and
    model thread go on. Its first grammar also built llguidance's tokenizer there, which holds
    Python's GIL throughout (1.4 s with Qwen2.5's vocabulary on the CI host: copying the Rust
    tokenizer, then llguidance's own build): nothing else in the worker ran meanwhile (the
    draft's proposals timed out, every session's steps waited). It is now built with the model;
    a compile lets go of the GIL."""
    qwen = real_tokenizer("qwen2.5-coder-0.5b", tmp_path_factory)
    masks = GrammarMasks.build(qwen, len(qwen), [qwen.eos_token_id])  # as the worker loads
    assert masks is not None
    ticks: list[float] = []
    watching = threading.Event()

    def watch() -> None:  # notes the time every millisecond it gets the GIL
        while not watching.is_set():
            time.sleep(0.001)
            ticks.append(time.perf_counter())

    watcher = threading.Thread(target=watch)
    watcher.start()
    time.sleep(0.05)
    began = time.perf_counter()
    masks.compile(grammar_of(SO(json_object=True)))
    ended = time.perf_counter()
    time.sleep(0.05)
    watching.set()
    watcher.join()
    during = [t for t in ticks if began - 0.01 <= t <= ended + 0.01]
    longest = max(b - a for a, b in itertools.pairwise(during))
    assert longest < 0.15, f"the watcher waited {longest:.3f} s for the GIL during a {ended - began:.3f} s compile"


def test_a_tokenizer_llguidance_cannot_read_turns_grammars_off(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Rust-backed tokenizer llguidance still fails to read (found when the model loads): its
    Info says it applies no grammars (``failed``), the target refuses constrained steps as a
    worker without grammars (UNIMPLEMENTED, so that the coordinator verifies them elsewhere),
    the build is not tried again on every request, and the draft drafts unmasked."""
    import specdec.runtime.grammar as grammar_module

    tries: list[int] = []

    def unreadable(*args: object, **kwargs: object) -> None:
        tries.append(1)
        raise ValueError("unsupported pre-tokenizer")

    monkeypatch.setattr(grammar_module, "LLTokenizer", unreadable)
    masks = GrammarMasks.build(tokenizer, len(tokenizer), [EOS])
    assert masks is not None and masks.failed
    grammar = grammar_of(SO(regex="ab"))
    for _ in range(2):
        with pytest.raises(GrammarsUnavailable):
            masks.compile(grammar)
    assert len(tries) == 1
    logits, reply = torch.randn(1, len(tokenizer)), ids(tokenizer, "P:")
    with pytest.raises(GrammarsUnavailable):
        constrain(logits, GrammarState(masks), reply, len(reply), grammar, 2, strict=True)
    assert constrain(logits, GrammarState(masks), reply, len(reply), grammar, 2, strict=False) is logits


def test_a_constraint_seen_lately_is_not_checked_again() -> None:
    """Clients send the same few schemas: the coordinator keeps the latest 64 checked grammars."""
    schema = json.dumps({"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(50)}})
    first = grammar_of(SO(json_schema=schema))
    hits = _checked.cache_info().hits
    assert grammar_of(SO(json_schema=schema)) == first and _checked.cache_info().hits == hits + 1
    assert grammar_of(SO(json_schema=schema), "other.field") == first  # the field names its errors only


async def test_a_verdict_that_says_nothing_of_the_grammar_is_not_taken() -> None:
    """A replica that ignores the grammar (a worker older than structured output, which drops the
    field it does not know, after a rollback the coordinator has not read yet) answers a
    constrained step with an unconstrained verdict: the coordinator does not take it, verifies the
    step on a replica whose verdict says the grammar masked it, and constrained turns leave the
    old replica out from then on (without taking it out for other turns)."""
    from coordinator.worker_session import Decoding, WorkerSession
    from coordinator.workers import GrammarsRefused
    from specdec.runtime.processing import Processing
    from specdec.runtime.sampling import Warp
    from specdec.serving.metrics import CoordinatorMetrics

    old, new = FakeTarget("old:1", applies=False), FakeTarget("new:1", applies=True)
    metrics = CoordinatorMetrics(CollectorRegistry())
    decoding = Decoding(Warp(), 0, Processing(grammar=grammar_of(common_pb2.StructuredOutput(regex="[a-c]+"))))
    session = WorkerSession("s", FakeTargets(old, new), None, metrics, 5.0, None, constrained=True)  # type: ignore[arg-type]
    session.restore(CacheLocation("old:1", 0), None)  # the session's cache is on the old replica
    reply, _ = await session.verify([5, 17, 99], common_pb2.DraftBlock(), decoding)
    assert reply.constrained and (old.calls, new.calls) == (1, 1)
    assert not old.grammars and old.breaker.up
    assert session.target_address == "new:1"
    reply, _ = await session.verify([5, 17, 99, 7], common_pb2.DraftBlock(), decoding)
    assert reply.constrained and (old.calls, new.calls) == (1, 2)
    free = WorkerSession("t", FakeTargets(old, new), None, metrics, 5.0, None)  # type: ignore[arg-type]
    free.restore(CacheLocation("old:1", 0), None)
    await free.verify([5, 17], common_pb2.DraftBlock(), Decoding(Warp(), 0))
    assert (old.calls, new.calls) == (2, 2)  # unconstrained turns still use it
    alone = WorkerSession("u", FakeTargets(old), None, metrics, 5.0, None, constrained=True)  # type: ignore[arg-type]
    with pytest.raises(GrammarsRefused, match="no target worker that applies structured-output constraints"):
        await alone.verify([5, 17], common_pb2.DraftBlock(), decoding)
    assert old.calls == 2 and GrammarsRefused.code == grpc.StatusCode.UNAVAILABLE


async def test_a_replica_whose_info_cannot_be_read_again_keeps_what_was_known(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The periodic Info refresh survives a replica it cannot ask (no answer, or an error before
    the call, such as a token file being rotated): that replica keeps what was known, the others
    are read, and the refresh runs again next period."""
    from coordinator.settings import CoordinatorSettings
    from coordinator.workers import TargetPool

    pool = TargetPool(["127.0.0.1:1", "127.0.0.1:2"], CoordinatorSettings(target_addresses=["127.0.0.1:1"]), 1.0)
    broken, silent = pool.replicas
    broken.grammars = silent.grammars = True

    async def unreadable(timeout_s: float) -> None:
        raise OSError("token file is being replaced")

    monkeypatch.setattr(broken, "refresh_info", unreadable)
    await pool.refresh_info(0.2)  # nothing listens on either address
    assert broken.grammars and silent.grammars and pool.grammars
    assert "target_info_refresh_failed" in capsys.readouterr().out  # structlog, unconfigured in tests
    await pool.close()


@pytest.mark.parametrize(
    "constraint",
    [
        SO(grammar='start: start "a"'),  # a rule defined only through itself
        SO(grammar='root ::= root "x"'),
        SO(regex="[^\\x00-\\U0010FFFF]"),  # an empty character class
        SO(grammar="start: /[^\\x00-\\U0010FFFF]/"),
    ],
)
def test_a_constraint_no_reply_can_begin_is_refused_saying_so(constraint: common_pb2.StructuredOutput) -> None:
    """A grammar or regex no string can begin (its language is empty) passed the check and
    reached the workers, whose first mask failed with llguidance's bare "NoExtensionBias"
    (the client's INVALID_ARGUMENT said only "the structured-output constraint failed:
    NoExtensionBias", after warnings from both workers): it is refused when checked."""
    kind = constraint.WhichOneof("constraint")
    with pytest.raises(InvalidRequest, match=rf"structured_output.{kind} matches no string: no reply can begin"):
        grammar_of(constraint)


def test_a_grammar_that_cannot_go_on_after_the_reply_so_far_says_so(
    masks: GrammarMasks, tokenizer: PreTrainedTokenizerBase
) -> None:
    """A grammar whose every way on from the reply so far needs a rule no string completes (here
    `x`, defined only through itself, after "a"): no token is allowed there, and the request
    fails saying so, not with llguidance's bare "NoExtensionBias"; the check cannot see it
    before, since the reply can begin."""
    grammar = grammar_of(SO(grammar='start: "a" x\nx: x "b"'))
    reply = ids(tokenizer, "P:a")
    for strict in (True, False):
        with pytest.raises(InvalidRequest, match=r"allows no token after the reply so far .*fix the constraint"):
            constrain(torch.zeros(1, len(tokenizer)), GrammarState(masks), reply, len(reply), grammar, 2, strict=strict)


@pytest.mark.parametrize("text", ["\uf900", "A\u030a", "\u212b", "x\uf900y"])
def test_text_the_tokenizer_would_normalize_is_masked_as_the_matcher_reads_it(
    text: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Qwen2.5's tokenizer normalizes text to NFC (U+F900 to U+8C48, A + a combining ring and
    the angstrom sign to U+00C5). llguidance tokenized the text a constraint forces with it, so
    the masks allowed the normalized text's first token where the matcher follows the bytes: the
    next step found the reply off the constraint, and the request failed INTERNAL (found by the
    chat fuzz test: a choice of U+F900). Following the masks, each token they allow is one the
    matcher takes, and the reply is the text itself."""
    qwen = real_tokenizer("qwen2.5-coder-0.5b", tmp_path_factory)
    masks = GrammarMasks.build(qwen, len(qwen), [qwen.eos_token_id])
    assert masks is not None
    grammar, state, reply = grammar_of(SO(choice=common_pb2.Choices(values=[text]))), GrammarState(masks), []
    for _ in range(len(text.encode()) + 1):
        row = state.masked(torch.zeros(1, len(qwen)), reply, len(reply), grammar, 0)
        assert row is not None, f"the mask allowed {reply[-1]} after {reply[:-1]}, the matcher refuses it"
        choices = sorted(allowed(row[0]))
        if choices == [qwen.eos_token_id]:
            break
        reply.append(choices[0])
    assert qwen.decode(reply) == text
