"""`KvfsmSettings`: everything `kv_connector_extra_config` may set, with its default and why."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from kvfsm.core import CoreConfig, Mode
from kvfsm.fabric import UCX_ERROR_HANDLING_DEFAULT, UcxErrorHandling
from kvfsm.wire import SharedSecret

__all__ = ["KvfsmSettings", "SettingsError"]

# vLLM's NixlConnector takes its side channel from these; kvfsm does too where its own settings
# are absent, so a NixlConnector deployment runs by changing the connector's name alone.
_NIXL_ENV = {
    "side_channel_host": "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "side_channel_port": "VLLM_NIXL_SIDE_CHANNEL_PORT",
}


class SettingsError(ValueError):
    """`kv_connector_extra_config` is wrong; the message names the setting and what is allowed."""


class KvfsmSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The connector's settings, read from `kv_connector_extra_config` (unknown keys are refused,
    so a misspelt setting fails at start-up instead of being ignored)."""

    mode: Mode = "pull"
    """"pull" (D READs P's blocks, vLLM's NixlConnector) or "push" (P WRITEs into D's blocks,
    vLLM's NixlPushConnector). Both engines must run the same mode; the handshake checks it."""
    side_channel_host: str = "127.0.0.1"
    """Where this engine's handshake listener binds, and the address it advertises to peers (in
    P's transfer params and D's registrations). Loopback by default: set a routable address to
    serve peers on other hosts. Unset, `$VLLM_NIXL_SIDE_CHANNEL_HOST` gives it (vLLM's
    NixlConnector's setting)."""
    side_channel_port: int = 5600
    """The listener's port; data-parallel rank `i` listens on `side_channel_port + i`. Unset,
    `$VLLM_NIXL_SIDE_CHANNEL_PORT` gives it (vLLM's NixlConnector's setting)."""
    handshake_timeout_s: float = 10.0
    """A handshake that has not answered by then fails its requests (their blocks reported
    invalid on D)."""
    core: CoreConfig = msgspec.field(default_factory=CoreConfig)
    """The core's deadlines and bounds (`lease_s`, `watchdog_s`, `stall_s`, ... : see
    `CoreConfig`), given as top-level keys of the extra config."""
    conformance: bool = False
    """Replay every step the core takes through the `transitions` machine of its model at run
    time; a divergence (a bug) is logged on `vllm.kvfsm` and counted in `internal_errors`.
    Off by default: it costs a few microseconds a lifecycle (docs/performance.md)."""
    poll_min_us: float = 20.0
    """The engine loop polls NIXL this soon after activity, backing off to `poll_max_us`."""
    poll_max_us: float = 1000.0
    poll_hot_us: float | None = None
    """For this long after the last activity the loop keeps polling every `poll_min_us`;
    unset: 1000, or 0 on a pull-mode P (docs/runtime.md)."""
    gil_switch_interval_us: float = 250.0
    """The worker process's GIL switch interval (Python's default is 5000): the engine loop
    thread shares the GIL with vLLM's busy model-runner thread, and every hop of a hand-off
    (notification, post, completion) waits for the GIL; 0 leaves Python's setting alone."""
    device_fence: bool = True
    """With the KV cache on a GPU, P exposes a request's KV (posts the WRITE, grants the READ)
    only once a CUDA event recorded after the forward passes queued before it has completed
    (`DeviceFence`, docs/vllm.md). Off: rely on vLLM's scheduling alone."""
    drain_s: float = 5.0
    """At shutdown, let live transfers end this long before closing the NIXL agent."""
    ucx_error_handling: UcxErrorHandling = UCX_ERROR_HANDLING_DEFAULT
    """NIXL's UCX `ucx_error_handling_mode`: "peer" has UCX detect a failed peer (its transfers
    and notifications fail at once), "none" carries notifications over shared memory on one
    host (faster, no stall of a WRITE behind a notification) but leaves a crashed peer to the
    core's deadlines (`stall_s`, `watchdog_s`, `lease_s`), and on RDMA a peer's failure may be
    fatal to this process. Figures and the decision: docs/runtime.md."""
    shared_secret_env: str = "KVFSM_SHARED_SECRET"
    """The environment variable holding the deployment's shared secret (at least 16 bytes; the
    same on every P and D engine). Set, it authenticates every handshake and notification
    (HMAC-SHA256); unset or empty, peers are not authenticated (docs/security.md). The secret
    itself is not a setting: vLLM logs its configuration."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> KvfsmSettings:
        """Settings from `kv_connector_extra_config`; `SettingsError` says what is wrong."""
        flat = dict(extra or {})
        for key, variable in _NIXL_ENV.items():
            if key not in flat and os.environ.get(variable):
                flat[key] = os.environ[variable]
        core_keys = set(CoreConfig.__struct_fields__)
        core = {k: flat.pop(k) for k in list(flat) if k in core_keys}
        known = ", ".join(sorted((set(cls.__struct_fields__) - {"core"}) | core_keys))
        try:
            if "core" in flat:
                raise msgspec.ValidationError("give the core's settings as top-level keys")
            settings = msgspec.convert(flat, cls, strict=False)
            settings = msgspec.structs.replace(
                settings, core=msgspec.convert(core, CoreConfig, strict=False)
            )
        except (msgspec.ValidationError, ValueError) as exc:
            raise SettingsError(f"kv_connector_extra_config: {exc} (settings: {known})") from None
        settings._check()
        return settings

    def _check(self) -> None:
        problems = []
        if not 0 < self.side_channel_port < 65536:
            problems.append(f"side_channel_port must be 1..65535, not {self.side_channel_port}")
        if self.handshake_timeout_s <= 0 or self.drain_s < 0 or self.gil_switch_interval_us < 0:
            problems.append(
                "need handshake_timeout_s > 0, drain_s >= 0, gil_switch_interval_us >= 0"
            )
        if not 0 < self.poll_min_us <= self.poll_max_us or (self.poll_hot_us or 0) < 0:
            problems.append("need 0 < poll_min_us <= poll_max_us and poll_hot_us >= 0")
        try:
            self.secret()
        except SettingsError as exc:
            problems.append(str(exc))
        if problems:
            raise SettingsError("kv_connector_extra_config: " + "; ".join(problems))

    def secret(self) -> SharedSecret | None:
        """The shared secret from `$shared_secret_env`, or None if it is unset or empty."""
        value = os.environ.get(self.shared_secret_env, "") if self.shared_secret_env else ""
        try:
            return SharedSecret(value) if value else None
        except ValueError as exc:
            raise SettingsError(f"${self.shared_secret_env}: {exc}") from None

    def core_config(self) -> CoreConfig:
        """The deadlines and bounds of the core."""
        return self.core
