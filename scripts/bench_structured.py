"""Structured output on real checkpoints: tokens/s of JSON-schema replies with and without
speculation (and of unconstrained replies), and the constrained greedy replies checked token for
token against HF ``generate`` masked by a fresh llguidance matcher at every step.

    .venv/bin/python scripts/bench_structured.py TARGET_DIR DRAFT_DIR [--repeats 3] [--no-hf-check]

Runs target, int8 draft and coordinator as local processes (CPU workers take turns for the
cores); every configuration runs on every prompt, interleaved, after one warm-up request per
prompt (its cache is reused alike by every row). Prints medians and the spread as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.spec_oracle: the reference mask
from specdec.runtime.grammar import grammar_of
from specdec.tools.launch import LocalCluster
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.spec_oracle import reference_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "languages"],
}
TEXTS = [
    "Alice is 31 and writes Python and Rust.",
    "Bob, aged 45, codes in Go, C and Java.",
    "Carol (27) only uses TypeScript.",
]
CONFIGS = {  # name: (speculation, constrained)
    "speculative_json": ({}, True),
    "speculative_free": ({}, False),
    "target_only_json": ({"disable": True}, True),
    "target_only_free": ({"disable": True}, False),
}
MAX_NEW = 64


class _Masked(LogitsProcessor):
    def __init__(self, mask) -> None:  # type: ignore[no-untyped-def]
        self._mask = mask

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = [self._mask(scores[i], tuple(input_ids[i].tolist())) for i in range(scores.shape[0])]
        return torch.stack(rows)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-hf-check", action="store_true")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    constraint = common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    prompts = []
    for text in TEXTS:
        messages = [
            {"role": "system", "content": "Reply with JSON only."},
            {"role": "user", "content": f"Extract name, age and languages as JSON: {text}"},
        ]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered))
    speeds: dict[str, list[float]] = {name: [] for name in CONFIGS}
    replies: list[list[int]] = []
    with (
        tempfile.TemporaryDirectory() as workdir,
        LocalCluster(
            args.target, args.draft, Path(workdir), draft_args=["--quantize", "int8"], share_cpu=True
        ) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)

        def generate(ids: list[int], speculation: dict[str, bool], constrained: bool) -> tuple[float, list[int]]:
            sampling = common_pb2.SamplingParams(max_new_tokens=MAX_NEW)
            if constrained:
                sampling.structured_output.CopyFrom(constraint)
            request = coordinator_pb2.GenerateRequest(
                prompt_token_ids=common_pb2.TokenIds(ids=ids),
                sampling=sampling,
                speculation=coordinator_pb2.SpeculationParams(**speculation),
            )
            began = time.monotonic()
            reply = stub.Generate(request, timeout=600)
            return len(reply.token_ids) / (time.monotonic() - began), list(reply.token_ids)

        for ids in prompts:
            replies.append(generate(ids, {}, True)[1])  # warm-up; its reply is the one checked below
        for repeat in range(args.repeats):
            for ids in prompts:
                for name in CONFIGS if repeat % 2 == 0 else reversed(CONFIGS):
                    speed, _ = generate(ids, *CONFIGS[name])
                    speeds[name].append(speed)
    report: dict[str, object] = {
        name: {"median_tok_s": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2)}
        for name, v in speeds.items()
    }
    if not args.no_hf_check:
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        equal = []
        for ids, reply in zip(prompts, replies, strict=True):
            mask = reference_grammar(grammar_of(constraint), args.target, model.config.vocab_size, eos, len(ids))
            x = torch.tensor([ids])
            out = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                logits_processor=LogitsProcessorList([_Masked(mask)]),
            )  # fmt: skip
            equal.append(out[0, len(ids) :].tolist() == reply)
        report["greedy_equal_to_hf_masked"] = equal
    sys.stdout.write(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
