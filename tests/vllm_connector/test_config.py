"""The connector's inputs from configuration and clients: extra config, transfer params, and the
KV tensors vLLM registers. Each bad input gets an error naming what is wrong."""

from __future__ import annotations

import pytest
import torch

from kvfsm.vllm._geometry import LayoutError, geometry_of
from kvfsm.vllm._params import ParamsError, producer_params, remote_prefill
from kvfsm.vllm._settings import KvfsmSettings, SettingsError

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]


def test_settings_default_and_override() -> None:
    s = KvfsmSettings.from_extra_config({"mode": "push", "side_channel_port": 7000, "lease_s": 9})
    assert (s.mode, s.side_channel_port, s.core_config().lease_s) == ("push", 7000, 9.0)
    assert KvfsmSettings.from_extra_config(None).mode == "pull"
    assert not KvfsmSettings.from_extra_config(None).conformance  # opt-in
    assert KvfsmSettings.from_extra_config({"conformance": True}).conformance


def test_the_side_channel_falls_back_to_nixl_connectors_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A NixlConnector deployment gives each engine its side channel in the environment; kvfsm
    takes it where its own settings say nothing, and its own settings win."""
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5659")
    s = KvfsmSettings.from_extra_config(None)
    assert (s.side_channel_host, s.side_channel_port) == ("10.1.2.3", 5659)
    s = KvfsmSettings.from_extra_config({"side_channel_port": 7000})
    assert (s.side_channel_host, s.side_channel_port) == ("10.1.2.3", 7000)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "not-a-port")
    with pytest.raises(SettingsError, match="side_channel_port"):
        KvfsmSettings.from_extra_config(None)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST")
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT")
    s = KvfsmSettings.from_extra_config(None)
    assert (s.side_channel_host, s.side_channel_port) == ("127.0.0.1", 5600)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"mdoe": "push"}, "unknown field `mdoe`"),
        ({"mode": "sideways"}, "mode"),
        ({"side_channel_port": 70000}, "side_channel_port"),
        ({"heartbeat_s": 40, "lease_s": 30}, "heartbeat_s must be below lease_s"),
        ({"poll_min_us": 0}, "poll_min_us"),
        ({"poll_hot_us": -1}, "poll_hot_us"),
    ],
)
def test_settings_refuse_what_is_wrong(extra: dict[str, object], match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        KvfsmSettings.from_extra_config(extra)


def test_shared_secret_comes_from_the_named_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVFSM_SHARED_SECRET", raising=False)
    assert KvfsmSettings.from_extra_config(None).secret() is None  # unset: no authentication
    monkeypatch.setenv("MY_SECRET", "s" * 32)
    s = KvfsmSettings.from_extra_config({"shared_secret_env": "MY_SECRET"})
    secret = s.secret()
    assert secret is not None and "s" * 32 not in repr(s) + repr(secret)
    monkeypatch.setenv("MY_SECRET", "short")  # refused at start-up, naming the variable
    with pytest.raises(SettingsError, match=r"\$MY_SECRET: a shared secret needs at least 16"):
        KvfsmSettings.from_extra_config({"shared_secret_env": "MY_SECRET"})


def _p_params(**override: object) -> dict[str, object]:
    params = producer_params(
        request_id="cmpl-1",
        block_ids=[3, 4],
        engine_id="P-engine",
        host="10.0.0.1",
        port=5600,
        tp_size=2,
        num_tokens=40,
        mode="pull",
    )
    return params | override


def test_params_round_trip_from_p_to_d() -> None:
    remote = remote_prefill(_p_params(), "pull")
    assert (remote.remote_engine_id, remote.remote_request_id, remote.tp_size) == (
        "P-engine",
        "cmpl-1",
        2,
    )
    assert remote.contact == "10.0.0.1:5600"
    assert remote_prefill(_p_params(remote_host="::1"), "pull").contact == "[::1]:5600"


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"remote_port": "5600"}, "Expected `int`"),
        ({"remote_port": 0}, "remote_port"),
        ({"remote_engine_id": ""}, "remote_engine_id"),
        ({"remote_request_id": "x" * 1000}, "remote_request_id"),
        ({"tp_size": -1}, "tp_size"),
        ({"transfer_mode": "push"}, "this D runs 'pull'"),
    ],
)
def test_params_from_a_client_are_validated(override: dict[str, object], match: str) -> None:
    with pytest.raises(ParamsError, match=match):
        remote_prefill(_p_params(**override), "pull")
    with pytest.raises(ParamsError, match="remote_host"):
        params = _p_params()
        del params["remote_host"]
        remote_prefill(params, "pull")


def test_cpu_layout_is_read_off_the_tensors() -> None:
    # vLLM's CPU backend: (blocks, heads, tokens, K|V) per layer.
    layers = {f"model.layers.{i}.self_attn.attn": torch.zeros(8, 1, 32, 128) for i in (10, 9)}
    g, buffers = geometry_of(layers, block_size=32, num_kv_heads=2, tp_size=2, tp_rank=1)
    assert (g.kv_layout, g.num_layers, g.num_blocks, g.block_size) == ("HNC", 2, 8, 32)
    assert (g.num_kv_heads, g.heads_per_rank, g.head_dim, g.dtype_bytes) == (2, 1, 64, 4)
    assert buffers[0] is layers["model.layers.9.self_attn.attn"]  # natural order: 9 before 10


def test_split_kv_and_mla_layouts() -> None:
    g, buffers = geometry_of(
        {"l0": torch.zeros(2, 4, 16, 2, 8)}, block_size=16, num_kv_heads=2, tp_size=1, tp_rank=0
    )
    assert (g.kv_layout, g.split_kv, len(buffers)) == ("NHD", True, 2)
    g, _ = geometry_of(
        {"l0": torch.zeros(4, 16, 576)},
        block_size=16,
        num_kv_heads=1,
        tp_size=2,
        tp_rank=0,
        mla=True,
    )
    assert g.mla and g.head_dim == 576


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ({}, "no KV cache tensors"),
        ({"a": torch.zeros(8, 2, 32, 128), "b": torch.zeros(8, 2, 32, 64)}, "differ in shape"),
        ({"a": torch.zeros(8, 2, 12, 128)}, "12-token blocks, which do not divide"),
        ({"a": torch.zeros(8, 1, 32, 128)}, "replicated KV heads"),
        ({"a": torch.zeros(8, 2, 32, 2, 64)}, "not a layout"),
        ({"a": torch.zeros(128, 32, 2, 8).permute(3, 2, 1, 0)}, "VLLM_KV_CACHE_LAYOUT=LBHNC"),
    ],
)
def test_layouts_kvfsm_cannot_move_are_refused(layers: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        geometry_of(layers, block_size=32, num_kv_heads=2, tp_size=1, tp_rank=0)
