"""Settings shared by every service: one pydantic-settings class per service derives from these."""

from __future__ import annotations

import difflib
import importlib
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Literal, TypeVar

import structlog
from pydantic import BeforeValidator, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, CliApp, CliSettingsSource, NoDecode, SettingsConfigDict

if TYPE_CHECKING:
    from specdec.runtime.modeling import LoadOptions

S = TypeVar("S", bound="ServiceSettings")
log = structlog.get_logger()

ENV_PREFIX = "SPECDEC_"
# every service's settings (named, not imported: the roles build on this module); one
# environment often serves them all (k8s/'s shared ConfigMap)
ROLE_SETTINGS = (
    "coordinator.settings:CoordinatorSettings",
    "draft_worker.settings:DraftSettings",
    "target_worker.settings:TargetSettings",
)
OTHER_VARIABLES = frozenset({"SPECDEC_MODELS"})  # `specdec models fetch`'s folder
# a prompt's tokens per forward pass by default: on a CPU a chunk of 256 holds other sessions up
# ~1.8 s with a 1.5B model, and 256-token chunks prefilled 2,048 tokens no slower than one pass
CPU_PREFILL_CHUNK_TOKENS = 256
ACCELERATOR_PREFILL_CHUNK_TOKENS = 2048


def _list_of_strings(value: object) -> object:
    """A list setting given as one string (an environment variable, a flag): a JSON list, or
    values separated by commas ("" = none)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text.startswith("["):
        return text.split(",") if text else []
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"expected a JSON list of strings or comma-separated values ({exc})") from None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ValueError("expected a JSON list of strings or comma-separated values")
    return items


# A list of strings, from flags and the environment alike: a JSON list or comma separated.
StringList = Annotated[list[str], NoDecode, BeforeValidator(_list_of_strings)]


class ServiceSettings(BaseSettings):
    """Network, logging and lifecycle settings common to all services (env prefix SPECDEC_)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="ignore",
        validate_default=True,
    )

    host: str = Field("0.0.0.0", description="address to listen on")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = pick a free port)")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_format: Literal["json", "console"] = Field("json", description="log line format")
    grace_period_s: float = Field(20.0, ge=0, description="on SIGTERM, time for in-flight RPCs to finish")
    stream_write_timeout_s: float = Field(
        60.0,
        ge=0,
        description="a stream message the client takes none of for this long ends the call "
        "(it stopped reading; its turn is rolled back); 0 = wait for ever",
    )
    max_connection_age_s: float = Field(
        0.0,
        ge=0,
        le=7 * 24 * 3600,  # grpc takes milliseconds as a 32-bit int
        description="end each client connection after about this long (HTTP/2 GOAWAY; its calls in flight go on), "
        "so clients reconnect and spread over the replicas there are then; 0 = never",
    )
    ready_file: str | None = Field(
        None, description='write {"port": N} to this file once serving (for launchers and tests)'
    )
    max_message_bytes: int = Field(64 * 1024 * 1024, gt=0, description="largest gRPC message accepted or sent")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve Prometheus /metrics on this port (0 = a free port; unset = off)"
    )
    health_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="plaintext port serving only grpc.health.v1 (for probes when the API port uses TLS)",
    )
    tls_cert_file: str | None = Field(None, description="PEM certificate chain: serve TLS (with --tls-key-file)")
    tls_key_file: str | None = Field(None, description="PEM private key of --tls-cert-file")
    tls_client_ca_file: str | None = Field(
        None, description="PEM CA bundle: require client certificates signed by it (mTLS)"
    )
    tls_allowed_client_names: StringList = Field(
        default_factory=list,
        description="with mTLS: only client certificates with one of these CN/SAN names (comma separated)",
    )
    auth_tokens_file: str | None = Field(
        None, description="file of 'identity:token' lines: every API call needs 'authorization: Bearer <token>'"
    )
    local_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="a plaintext API port bound to 127.0.0.1 only, without tokens, for a sidecar in the same pod "
        "(the OpenAI gateway); unset = none",
    )

    @model_validator(mode="after")
    def _tls_complete(self) -> ServiceSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mTLS) needs tls_cert_file and tls_key_file")
        if self.tls_allowed_client_names and not self.tls_client_ca_file:
            raise ValueError("tls_allowed_client_names needs tls_client_ca_file (client certificates)")
        return self


class ModelWorkerSettings(ServiceSettings):
    """Settings of a service that holds a model."""

    model: str = Field(description="local Hugging Face model directory or hub id")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$", description="auto|cpu|cuda[:n]|mps")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="weight dtype (auto = bfloat16 on CUDA, float32 otherwise)"
    )
    max_sessions: int = Field(256, gt=0, description="KV caches kept at most; the least recently used is evicted")
    max_cache_tokens: int = Field(
        0,
        ge=0,
        description="tokens all KV caches hold at most; the least recently used caches are freed (0 = half the "
        "memory free after loading, divided by the model's KV bytes per token)",
    )
    session_idle_s: float = Field(900.0, gt=0, description="a cache unused this long is freed")
    torch_threads: int = Field(
        0, ge=0, description="intra-op CPU threads for torch (0 = torch's default, at most the CPU quota's whole CPUs)"
    )
    trust_remote_code: bool = Field(False, description="allow model code from the model repository")
    quantize: Literal["none", "int8", "int4"] = Field(
        "none",
        description="int8 = dynamic int8 Linear layers; int4 = int4 weights (groups of 32) for passes of one or "
        "two tokens and int8 for wider ones (both for a CPU draft)",
    )
    cpu_kernel: Literal["auto", "packed", "torch"] = Field(
        "auto",
        description="Linear layers of a float32 or bfloat16 CPU model: packed = weights pre-packed for oneDNN once "
        "at load (faster, most of all for the few rows of a verify block); torch = nn.Linear; auto = packed where "
        "available (bfloat16: where oneDNN computes it on this CPU)",
    )
    max_draft_tokens: int = Field(64, gt=0, description="largest draft block this worker takes")
    max_batch: int = Field(16, gt=0, description="requests whose steps share one forward pass at most")
    batch_wait_ms: float = Field(
        5.0,
        ge=0,
        description="before a forward pass, wait at most this long (and half a pass) for the sessions whose last step "
        "just ended and whose measured round trip ends within the wait to send their next, so that they share the "
        "pass; not with --cpu-lock-file; 0 = never wait",
    )
    warm_up_widths: int = Field(
        17,
        ge=0,
        description="at start-up, one forward pass of every width from 1 to this (at most max_draft_tokens + 1) over "
        "a short cache: a width's first pass pays one-time costs (kernels chosen for its shapes), which the "
        "coordinator would time as the width's cost; where a one-token pass takes 0.1 s or more and its first cost "
        "no more than 1.1x a second one, the other widths are not run (17 = a block of the coordinator's default "
        "--max-speculative-tokens and the target's token; 0 = none)",
    )
    prefill_chunk_tokens: int = Field(
        0,
        ge=0,
        description="a prompt's tokens one forward pass computes at most; the other sessions' steps run between "
        f"the chunks (0 = {CPU_PREFILL_CHUNK_TOKENS} on a CPU, {ACCELERATOR_PREFILL_CHUNK_TOKENS} on a GPU)",
    )
    cpu_lock_file: str | None = Field(
        None, description="CPU workers on one host sharing this file run one forward pass at a time (no core fights)"
    )
    structured_output: bool = Field(
        True,
        description="apply structured-output grammars (llguidance); false: Info says so, and the coordinator sends "
        "constrained requests to other replicas or refuses them",
    )

    def prefill_chunk(self, device_type: str) -> int:
        """A prompt's tokens one forward pass computes at most, for a model on ``device_type``."""
        if self.prefill_chunk_tokens:
            return self.prefill_chunk_tokens
        return CPU_PREFILL_CHUNK_TOKENS if device_type == "cpu" else ACCELERATOR_PREFILL_CHUNK_TOKENS

    def rollback_margin(self) -> int:
        """Positions a windowed attention layer's cache keeps before its window: room for the
        deepest cut back of a round (a pipelined draft's block, its guess of the next token and the
        block after it, ``max_draft_tokens`` each); a deeper one is a resync."""
        return 2 * self.max_draft_tokens + 2

    def load_options(self) -> LoadOptions:
        """How to load the model."""
        from specdec.runtime.modeling import LoadOptions

        return LoadOptions(
            self.device, self.dtype, self.quantize, self.cpu_kernel, self.trust_remote_code,
            structured_output=self.structured_output,
        )  # fmt: skip


# the variables Kubernetes sets in a pod for each Service of its namespace (unless the pod sets
# enableServiceLinks: false): NAME_SERVICE_HOST, NAME_SERVICE_PORT[_PORTNAME], NAME_PORT=tcp://IP:PORT,
# NAME_PORT_<port>_<protocol>[_PROTO|_PORT|_ADDR]
_SERVICE_LINK_NAME = re.compile(r".+_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)")
_SERVICE_LINK_VALUE = re.compile(r"(tcp|udp|sctp)://\S+:\d+")


def _service_link(name: str, value: str) -> bool:
    """``name`` is a variable Kubernetes set for a Service (a Service named ``specdec`` makes
    SPECDEC_PORT=tcp://IP:PORT and SPECDEC_SERVICE_HOST, ...)."""
    return bool(_SERVICE_LINK_NAME.fullmatch(name.upper()) or _SERVICE_LINK_VALUE.fullmatch(value))


def load_settings(cls: type[S], argv: Sequence[str], prog: str) -> S:
    """Builds settings from CLI flags (kebab-case), then SPECDEC_* env, then defaults.

    Invalid settings stop start-up: one line per problem on stderr, exit status 2.
    """
    source: CliSettingsSource[S] = CliSettingsSource(
        cls, cli_prog_name=prog, cli_kebab_case=True, cli_implicit_flags=True
    )
    try:
        return CliApp.run(cls, cli_args=list(argv), cli_settings_source=source)
    except ValidationError as exc:
        for error in exc.errors(include_url=False, include_input=False):
            name = ".".join(str(part) for part in error["loc"])
            where = f" {name} (--{name.replace('_', '-')} / SPECDEC_{name.upper()})" if name else "s"
            sys.stderr.write(f"{prog}: invalid setting{where}: {error['msg']}{_link_hint(name)}\n")
        raise SystemExit(2) from None


def _link_hint(setting: str) -> str:
    """Who set the setting's variable, where it looks like Kubernetes' link to a Service."""
    variable = f"{ENV_PREFIX}{setting.upper()}"
    value = next((v for k, v in os.environ.items() if k.upper() == variable), "")
    if not setting or not variable.endswith("_PORT") or not _SERVICE_LINK_VALUE.fullmatch(value):
        return ""
    service = variable.removesuffix("_PORT").lower().replace("_", "-")
    return (
        f"; {variable}={value} is what Kubernetes sets in every pod of a namespace with a Service named "
        f"{service!r} (a service link): set enableServiceLinks: false in the pod spec, or set {variable} yourself"
    )


def unknown_environment(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The SPECDEC_* variables in ``environ`` that no service reads (matched without regard to
    case, as pydantic-settings matches them), each with the variable it most resembles, if any."""
    known = {name.removeprefix(ENV_PREFIX) for name in OTHER_VARIABLES}
    for ref in ROLE_SETTINGS:
        module, name = ref.split(":")
        settings: type[BaseSettings] = getattr(importlib.import_module(module), name)
        known |= {field.upper() for field in settings.model_fields}
    unknown = [
        name for name in environ if name.upper().startswith(ENV_PREFIX) and not _service_link(name, environ[name])
    ]
    unknown = [name for name in unknown if name.upper().removeprefix(ENV_PREFIX) not in known]

    def near(name: str) -> str | None:  # the names after the prefix, which every one shares
        close = difflib.get_close_matches(name.upper().removeprefix(ENV_PREFIX), known, n=1, cutoff=0.75)
        return ENV_PREFIX + close[0] if close else None

    return [(name, near(name)) for name in unknown]


def log_unknown_environment() -> None:
    """Warns of each SPECDEC_* variable that no service reads (a misspelt setting is otherwise
    ignored, and the service runs with the default the operator meant to change); never logs
    a value."""
    for name, near in unknown_environment(os.environ):
        log.warning("unknown_setting", variable=name, did_you_mean=near, effect="ignored: no specdec service reads it")
