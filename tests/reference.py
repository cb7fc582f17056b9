"""Reference outputs and request helpers shared by the integration and fault tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import grpc
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from specdec.state import SessionRecord, open_store
from specdec.tools.launch import LocalCluster
from specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
)
from tests.spec_oracle import Processor

# Seeded requests sent at once by the sampled tests through the service: the workers batch them,
# as they do concurrent clients, and each reply is decided by its seed alone. 16 rather than 8:
# wider batched passes share each pass's fixed cost (the load of the windowed chi-square test,
# 400 requests: 30.6-40.9 ms a request at 16 against 39.7-51.6 at 8 over three runs each).
SAMPLED_AT_ONCE = 16


@cache
class AsLogitsProcessor(LogitsProcessor):
    """An independent reference processing (tests/spec_oracle.py: (logits, sequence before) ->
    processed logits) as an HF logits processor."""

    def __init__(self, processor: Processor) -> None:
        self._processor = processor

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = [self._processor(scores[i], tuple(input_ids[i].tolist())) for i in range(scores.shape[0])]
        return torch.stack(rows)  # type: ignore[return-value]


def reference_greedy(
    model_dir: str, prompt: tuple[int, ...], max_new: int, ignore_eos: bool = False, mask: Processor | None = None
) -> list[int]:
    """Greedy target-only output from HF generate (fp32, CPU); ``ignore_eos`` generates past EOS;
    ``mask``: a structured-output reference (tests/spec_oracle.py) applied at every step."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig.from_model_config(model.config) if not ignore_eos else GenerationConfig()
    pad = model.config.get_text_config(decoder=True).pad_token_id  # a composite config keeps it there
    config.update(max_new_tokens=max_new, do_sample=False, pad_token_id=pad)
    if ignore_eos:
        # generate() fills an unset eos_token_id from the model's own generation config, so that
        # one has to go too, or the reference stops at EOS where the service generates on.
        config.eos_token_id = None
        model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    processors = LogitsProcessorList([AsLogitsProcessor(mask)] if mask is not None else [])
    # An explicit attention mask: generate() would otherwise treat pad-token ids in the prompt as padding.
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), generation_config=config, logits_processor=processors
    )
    return out[0, len(prompt) :].tolist()


def make_request(
    prompt: list[int], k: int = 4, max_new: int = 24, session_id: str = "", fixed: bool = True, **sampling: object
) -> coordinator_pb2.GenerateRequest:
    """A token-id request; ``fixed`` (default) speculates exactly K per round, as the exactness
    tests need; ``fixed=False`` lets the server adapt K."""
    return coordinator_pb2.GenerateRequest(
        session_id=session_id,
        prompt_token_ids=common_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, **sampling),
        speculation=coordinator_pb2.SpeculationParams(num_speculative_tokens=k, fixed=fixed),
    )


def seeded_replies(
    address: str, request: coordinator_pb2.GenerateRequest, n: int, metadata: tuple[tuple[str, str], ...] = ()
) -> list[coordinator_pb2.GenerateResponse]:
    """``request`` sent ``n`` times with seeds 0 .. n-1, SAMPLED_AT_ONCE at a time over one channel
    (the workers batch them, as they do concurrent clients); the replies in seed order."""

    def one(seed: int) -> coordinator_pb2.GenerateResponse:
        seeded = coordinator_pb2.GenerateRequest()
        seeded.CopyFrom(request)
        seeded.sampling.seed = seed
        return stub.Generate(seeded, metadata=metadata, timeout=120)

    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(SAMPLED_AT_ONCE) as pool:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        return list(pool.map(one, range(n)))


def coordinator_stub(cluster: LocalCluster) -> Iterator[coordinator_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield coordinator_pb2_grpc.GenerationStub(channel)


def find_session(url: str, session_id: str) -> SessionRecord | None:
    """A session record straight from the state store (for assertions about what was committed);
    None where there is no such session."""

    async def read() -> SessionRecord | None:
        store = open_store(url, ttl_s=60, lease_s=60, timeout_s=2)
        await store.start()
        record = await store.get(session_id)
        await store.close()
        return record

    return asyncio.run(read())


def read_session(url: str, session_id: str) -> SessionRecord:
    """The record of a session that must be there (see ``find_session``)."""
    record = find_session(url, session_id)
    assert record is not None, f"session {session_id} not found"
    return record


@cache
def _greedy_model(model_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _next_logits(model_dir: str, history: Sequence[int]) -> torch.Tensor:
    """The logits after ``history``: one plain forward pass over all of it, no cache, only the
    last position's logits computed."""
    with torch.inference_mode():
        return _greedy_model(model_dir)(torch.tensor([list(history)]), logits_to_keep=1).logits[0, -1]


NEAR_TIE = 1e-4  # logits this close are a float near tie (see greedy_continuation)


def greedy_continuation(model_dir: str, history: list[int], n: int, prefer: Sequence[int] = ()) -> list[int]:
    """The ``n`` tokens target-only greedy decoding gives after ``history``, end-of-sequence
    ignored: each the argmax of one plain forward pass over all the tokens before it, no cache
    (the model loaded once per directory; for many short checks, where ``reference_greedy``'s
    loading would dominate). Only the last position's logits are computed: over a real
    tokenizer's vocabulary every position's were most of a tiny model's pass.

    ``prefer``: tokens a service gave; at a position where its token's logit is within
    ``NEAR_TIE`` of the best one, it is taken instead (a float near tie: the service's cached and
    batched passes sum in another order than this uncached pass; its log-probabilities differed
    from this pass's by up to 4.1e-6 over 384 positions of 4 pipelined sessions at once, HF's own
    cached pass by up to 1.7e-5 over 3,000 random histories of the tiny target, while the
    smallest gap between the two best logits in the 2,252 positions one end-to-end fuzz run
    checked was 1.6e-4). Any other token stays a difference."""
    ids = list(history)
    for i in range(n):
        logits = _next_logits(model_dir, ids)
        best = int(logits.argmax())
        if i < len(prefer) and 0 <= prefer[i] < len(logits) and logits[best] - logits[prefer[i]] <= NEAR_TIE:
            best = prefer[i]
        ids.append(best)
    return ids[len(history) :]


def logit_gap(model_dir: str, history: Sequence[int], token: int) -> float:
    """How far ``token``'s logit lies below the best one after ``history`` (0 for the argmax), from
    the uncached pass ``greedy_continuation`` makes: what a failure message shows to tell a float
    near tie (a gap about ``NEAR_TIE`` or less) from a wrong token."""
    logits = _next_logits(model_dir, history)
    return float(logits.max() - logits[token])
