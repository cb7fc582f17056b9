"""Draft worker settings (env prefix SPECDEC_, or the matching --kebab-case flags)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from specdec.runtime.modeling import LoadOptions
from specdec.serving.settings import ModelWorkerSettings


class DraftSettings(ModelWorkerSettings):
    """Settings of `specdec serve draft`."""

    port: int = Field(50052, ge=0, le=65535, description="gRPC port (0 = pick a free port)")
    max_draft_tokens: int = Field(64, gt=0, description="largest block a request may ask for")
    proposal_top_n: int = Field(
        64, ge=0, description="sampled drafts propose from the renormalised top-n tokens (0 = full distribution)"
    )
    draft_layers: int = Field(
        0,
        ge=0,
        description="early-exit draft: load --model (the target's checkpoint) and keep only its first N decoder "
        "layers, its final norm and LM head (0 = the whole model)",
    )
    guess_tokens: int = Field(
        8,
        ge=0,
        le=64,
        description="each draft pass may also run up to N tokens guessed from the session's own n-grams (what "
        "followed the latest earlier occurrence of its last tokens), as many as the session's rate of right guesses "
        "makes worth it; where the draft draws them, their passes are saved. Exact either way (0 = off)",
    )
    draft_vocab: str | None = Field(
        None,
        description="a `specdec draft-vocab` file: the draft's output layer scores only the tokens it lists (each "
        "step cheaper; the draft proposes only those; exact either way) (unset = the whole vocabulary)",
    )

    target_tokenizer: str | None = Field(
        None,
        description="the target model's directory or hub id, when this draft's tokenizer differs from the target's: "
        "proposals are translated to the target's vocabulary by --vocab-method (unset = the same tokenizer)",
    )
    vocab_method: Literal["tli", "slem"] = Field(
        "tli",
        description="with --target-tokenizer: tli = sample only tokens both vocabularies have (exact, greedy and "
        "sampled); slem = draft greedily and re-tokenize the text for the target (exact, proposed one-hot)",
    )

    def load_options(self) -> LoadOptions:
        options = super().load_options()
        return dataclasses.replace(options, layers=self.draft_layers, output_vocab=self.draft_vocab or "")
