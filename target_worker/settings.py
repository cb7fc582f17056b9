"""Target worker settings (env prefix SPECDEC_, or the matching --kebab-case flags)."""

from __future__ import annotations

from pydantic import Field

from specdec.serving.settings import ModelWorkerSettings


class TargetSettings(ModelWorkerSettings):
    """Settings of `specdec serve target`."""

    port: int = Field(50053, ge=0, le=65535, description="gRPC port (0 = pick a free port)")
    max_draft_tokens: int = Field(64, gt=0, description="largest draft block accepted for verification")
