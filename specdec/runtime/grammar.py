"""Structured output: the reply must follow a grammar (a JSON schema, any JSON object, a regular
expression, a Lark or GBNF grammar, or one of a list of strings), enforced by masking the logits
of every token the grammar does not allow at that point (llguidance computes the masks).

A mask is one more piece of history-dependent processing: under speculation one verify pass
scores several positions, and row ``r`` (the token at ``first_position + r``) is masked with the
grammar's state after the reply's tokens before it, the drafts before the row included. A draft
token the grammar does not allow gets probability 0 at its row, so the target rejects it there
and the rows after it decide nothing. The draft masks its own proposals the same way (acceptance
stays high; exactness does not depend on it). Each session cache keeps its matcher between calls
(``GrammarState``): a call consumes the tokens added since the last one and rolls back those cut.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

import structlog
import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper, grammar_from
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from specdec.runtime.tokens import common_prefix_len
from specdec.serving.errors import GrammarsUnavailable, InvalidRequest
from specdec.v1 import common_pb2

log = structlog.get_logger(__name__)

# How a worker's message about the request's constraint begins (the compile with its tokenizer
# failed, or the parse outgrew the work limits): the coordinator passes such an INVALID_ARGUMENT
# on to its client as the request's own error, where other worker errors are its own.
CONSTRAINT_ERROR = "the structured-output constraint "
# How a worker's refusal of any grammar begins (GrammarsUnavailable, UNIMPLEMENTED): the coordinator
# then verifies the session on a replica that applies grammars.
NO_GRAMMARS = "this worker does not apply structured-output constraints"
# llguidance's error where a mask allows no token, not even the end (the grammar is not complete)
_NO_TOKEN_ALLOWED = "NoExtensionBias"
MAX_GRAMMAR_CHARS = 100_000  # a schema, expression or grammar longer than this is refused
MAX_CHOICES = 1024
_TEMPLATES_KEPT = 64  # compiled grammars a worker keeps (a session copies one)
_BIT = torch.arange(32, dtype=torch.int32)


def _limits() -> LLParserLimits:
    """llguidance's default work limits (a mask costs a few ms at worst), without the parser
    state in error messages (they reach clients)."""
    return LLParserLimits(verbose_errors=False)


def grammar_of(structured: common_pb2.StructuredOutput, field: str = "structured_output") -> str:
    """The llguidance grammar a request's constraint asks for ("" = none), checked; a constraint
    that is empty, malformed or too large is an InvalidRequest naming ``field`` and saying why.
    The latest constraints' grammars are kept (a service's clients send the same few schemas; a
    large one takes a few hundred ms to check)."""
    return _checked(structured.SerializeToString(deterministic=True), field)


@functools.lru_cache(maxsize=_TEMPLATES_KEPT)
def _checked(wire: bytes, field: str) -> str:
    structured = common_pb2.StructuredOutput.FromString(wire)
    kind = structured.WhichOneof("constraint")
    if kind is None:
        return ""
    name = f"{field}.{kind}"
    text = "" if kind in ("json_object", "choice") else getattr(structured, kind)
    if kind not in ("json_object", "choice") and not text.strip():
        raise InvalidRequest(f"{name} is empty")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"{name} has {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are allowed")
    try:
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, dict | bool):
                raise InvalidRequest(f"{name} must be a JSON object (a JSON schema)")
            grammar = LLMatcher.grammar_from_json_schema(text)
        elif kind == "json_object":
            if not structured.json_object:
                raise InvalidRequest(f"{name} must be true when set")
            grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}')
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(text)
        elif kind == "grammar":
            grammar = grammar_from("grammar", text)  # Lark, or GBNF (llama.cpp's, as vLLM takes)
        else:
            values = list(structured.choice.values)
            if not values or len(values) > MAX_CHOICES or not all(values):
                raise InvalidRequest(f"{name} needs 1 to {MAX_CHOICES} non-empty strings")
            if sum(map(len, values)) > MAX_GRAMMAR_CHARS:
                raise InvalidRequest(f"{name} has more than {MAX_GRAMMAR_CHARS} characters in all")
            grammar = grammar_from("choice", json.dumps(values))
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{name} is not valid JSON: {exc}") from None
    except ValueError as exc:
        raise InvalidRequest(f"{name} is not valid: {_first_line(str(exc))}") from None
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, None, limits=_limits())
    if failed:
        raise InvalidRequest(f"{name} is not valid: {_first_line(messages[0])}")
    if kind in ("regex", "grammar") and not _can_begin(grammar):  # llguidance refuses empty schemas itself
        raise InvalidRequest(
            f"{name} matches no string: no reply can begin to follow it (a rule defined only through "
            'itself, such as `x: x "b"`, or a character class that holds no character); fix the constraint'
        )
    return grammar


class _Bytes:
    """A vocabulary of every byte and an end-of-sequence token, as llguidance's TokenizerWrapper
    reads one: any text can be spelt with it, so a grammar whose first mask here allows nothing
    allows nothing with any model's tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = (*(bytes([byte]) for byte in range(256)), b"</s>")
    special_token_ids = (256,)

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _byte_tokenizer() -> LLTokenizer:
    return LLTokenizer(TokenizerWrapper(_Bytes()))


def _can_begin(grammar: str) -> bool:
    """Whether a reply can begin under ``grammar`` (llguidance finds out only when it computes a
    mask: one with no byte and no end allowed stops it with NoExtensionBias)."""
    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=_limits())
    if not matcher.is_error():  # (a grammar naming a model's special tokens does not compile here)
        matcher.compute_bitmask()
    return _first_line(matcher.get_error()) != _NO_TOKEN_ALLOWED


def _failure(matcher: LLMatcher) -> InvalidRequest:
    """The request's error for a matcher that stopped in error, in words a client can act on."""
    error = _first_line(matcher.get_error())
    if error == _NO_TOKEN_ALLOWED:
        return InvalidRequest(
            f"{CONSTRAINT_ERROR}allows no token after the reply so far (every way on needs a rule no string "
            "completes, such as one defined only through itself, or text this model's tokens cannot spell); "
            "fix the constraint"
        )
    return InvalidRequest(f"{CONSTRAINT_ERROR}failed: {error}")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "rejected by the grammar compiler"


_UNICODE_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})


def _as_matched(tokenizer: PreTrainedTokenizerFast) -> str:
    """The tokenizer as llguidance reads it (its Rust ``tokenizers`` JSON, without padding or
    truncation), less any Unicode normalization (NFC and the like; other normalizers, such as
    SentencePiece's spaces, stay). llguidance tokenizes the text a constraint forces with it, and
    a normalized tokenization spells other bytes than the constraint's where the text is not in
    that form (Qwen2.5's NFC: U+F900 is read as U+8C48): the mask then allowed a token its own
    matcher refuses. Text already in the form tokenizes the same either way."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["padding"] = spec["truncation"] = None
    spec["normalizer"] = _without_unicode_forms(spec.get("normalizer"))
    return json.dumps(spec)


def _without_unicode_forms(normalizer: dict[str, Any] | None) -> dict[str, Any] | None:
    if normalizer is None or normalizer.get("type") in _UNICODE_FORMS:
        return None
    if normalizer.get("type") == "Sequence":
        kept = [n for n in map(_without_unicode_forms, normalizer.get("normalizers", [])) if n is not None]
        return {**normalizer, "normalizers": kept} if kept else None
    return normalizer


class GrammarMasks:
    """One model's grammar compiler: its tokenizer as llguidance sees it (the end-of-sequence ids
    are the model's: a finished grammar allows only them) and the grammars compiled lately. The
    llguidance tokenizer is built with the model (1.4 s and 165 MB for Qwen2.5's 151,936 ids):
    building it holds Python's GIL throughout, so built on a first constrained request it stopped
    the worker's event loop and every session's steps meanwhile."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._n_vocab = max(vocab_size, len(tokenizer))
        self.words = (self._n_vocab + 31) // 32
        self.eos = frozenset(eos_ids)
        self._tokenizer: LLTokenizer | None = None
        try:
            spec = _as_matched(tokenizer)
            self._tokenizer = LLTokenizer(spec, n_vocab=self._n_vocab, eos_token=sorted(self.eos))
        except Exception as exc:  # a Rust-backed tokenizer llguidance still cannot read
            log.warning("structured_output_unavailable", reason=_first_line(str(exc)))
        self._templates: collections.OrderedDict[str, LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()  # compiles run off the model thread

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Sequence[int]) -> GrammarMasks | None:
        """None when the tokenizer is not of transformers' Rust (``tokenizers``) backend, the only
        one llguidance reads, or the model has no end-of-sequence id."""
        if not isinstance(tokenizer, PreTrainedTokenizerFast) or not eos_ids:
            return None
        return cls(tokenizer, vocab_size, eos_ids)

    @property
    def failed(self) -> bool:
        """llguidance could not read the tokenizer: no grammars here (Info says so)."""
        return self._tokenizer is None

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            raise GrammarsUnavailable(f"{NO_GRAMMARS}: llguidance cannot read its tokenizer")
        return self._tokenizer

    def holds(self, grammar: str) -> bool:
        with self._lock:
            return grammar in self._templates

    def compile(self, grammar: str) -> LLMatcher:
        """The compiled ``grammar``, kept (the least recently used go past ``_TEMPLATES_KEPT``).
        A worker compiles a request's grammar before its job reaches the model thread (a large
        schema takes a few hundred ms), so that other sessions' steps do not wait for it."""
        with self._lock:
            template = self._templates.pop(grammar, None)
        if template is None:
            template = LLMatcher(self.tokenizer, grammar, log_level=0, limits=_limits())
            if template.is_error():
                error = _first_line(template.get_error())
                raise InvalidRequest(f"{CONSTRAINT_ERROR}cannot be used: {error}")
        with self._lock:
            self._templates[grammar] = template
            while len(self._templates) > _TEMPLATES_KEPT:
                self._templates.popitem(last=False)
        return template

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher for ``grammar`` (a copy of the compiled one)."""
        return self.compile(grammar).deep_copy()

    def allowed(self, bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
        """[R, words] int32 bit masks -> [R, vocab] bool (ids past the tokenizer's: not allowed)."""
        bits = ((bitmask.unsqueeze(-1) >> _BIT.to(bitmask.device)) & 1).bool().flatten(1)
        if bits.shape[1] < vocab:
            bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)
        return bits[:, :vocab]


class GrammarState:
    """A session's matcher, kept with its cache: the grammar and reply start it was made for, and
    the reply tokens it has consumed (a call syncs it to the tokens before its first row)."""

    def __init__(self, masks: GrammarMasks) -> None:
        self.masks = masks
        self._key: tuple[str, int] | None = None
        self._matcher: LLMatcher | None = None
        self._consumed: list[int] = []

    def _synced(self, grammar: str, reply_start: int, reply: Sequence[int]) -> LLMatcher | None:
        """The matcher after ``reply`` (the reply's tokens so far); None if the grammar does not
        allow them."""
        if self._key != (grammar, reply_start) or self._matcher is None or self._matcher.is_error():
            self._key, self._matcher, self._consumed = (grammar, reply_start), self.masks.matcher(grammar), []
        matcher = self._matcher
        kept = common_prefix_len(self._consumed, reply)
        if kept < len(self._consumed):
            matcher.rollback(len(self._consumed) - kept)
            del self._consumed[kept:]
        added = list(reply[kept:])
        if matcher.validate_tokens(added) < len(added):
            return None
        if added and not matcher.consume_tokens(added):  # a work limit, not a token: the grammar's fault
            self._matcher = None
            raise _failure(matcher)
        self._consumed += added
        return matcher

    def masked(
        self, logits: torch.Tensor, tokens: Sequence[int], first_position: int, grammar: str, reply_start: int
    ) -> torch.Tensor | None:
        """``logits`` [R, V] with every token the grammar disallows at its row set to -inf (a new
        tensor); row r sees ``tokens[:first_position + r]``. Rows after a token the grammar does
        not allow, or after an end-of-sequence token, are left as they are (they decide nothing:
        that token has probability 0, or the reply ends at it). None when the reply before the
        first row already breaks the grammar."""
        matcher = self._synced(grammar, reply_start, tokens[reply_start:first_position])
        if matcher is None:
            return None
        rows, vocab = logits.shape
        bitmask = torch.full((rows, self.masks.words), -1, dtype=torch.int32)
        advanced = 0
        for row in range(rows):
            mask = bitmask[row]
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
            if row + 1 == rows:
                break
            token = tokens[first_position + row]
            if matcher.validate_tokens([token]) != 1:
                break
            matcher.consume_token(token)
            advanced += 1
            if token in self.masks.eos:  # the reply ends there
                break
        if advanced:
            matcher.rollback(advanced)
        if matcher.is_error():
            raise _failure(matcher)
        allowed = self.masks.allowed(bitmask.to(logits.device), vocab)  # unpacked where the logits are
        return logits.masked_fill(~allowed, float("-inf"))


def constrain(
    logits: torch.Tensor,
    state: GrammarState | None,
    tokens: Sequence[int],
    first_position: int,
    grammar: str,
    reply_start: int,
    *,
    strict: bool,
) -> torch.Tensor:
    """``logits`` masked by ``grammar`` row by row (see GrammarState.masked); unchanged without a
    grammar. ``strict`` (the target, whose masks make the output exact): a worker that cannot
    apply grammars, or a reply that already breaks the grammar, is the request's error; otherwise
    (the draft, whose masks only raise acceptance) the logits are left unmasked then."""
    if not grammar:
        return logits
    if state is None or state.masks.failed:
        if strict:
            raise GrammarsUnavailable(f"{NO_GRAMMARS} (see its Info)")
        return logits
    masked = state.masked(logits, tokens, first_position, grammar, reply_start)
    if masked is None:
        if strict:
            raise InvalidRequest("the reply so far does not follow the structured-output constraint")
        return logits
    return masked
