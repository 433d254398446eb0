"""Coverage-guided fuzzing (atheris, i.e. libFuzzer) of kvfsm's network and file decoders.

    python tests/fuzz/atheris_fuzz.py TARGET [libFuzzer options] [CORPUS_DIR ...]

TARGET is one of `wire` (notifications: `kvfsm.wire.decode`), `request` and `reply` (the
side channel's `decode_request` / `decode_reply`) or `scenario` (`load_scenario` on a file).
Each input must decode to something that re-encodes to itself, or raise the decoder's own error
(`WireError`, `SidechannelError`, `ScenarioError`); anything else is a crash, which libFuzzer
reports with the input that caused it (saved under `-artifact_prefix`). An empty or missing
corpus directory (a temporary one if none is given) is first seeded with valid encodings, so
mutations begin past the magic bytes. The scenario target writes each input to a file in
$KVFSM_FUZZ_SCRATCH (default: the temporary directory). `make fuzz` runs every target for a minute; tests/fuzz/test_atheris.py
runs each for a bounded number of inputs in CI. kvfsm's modules are instrumented for coverage;
msgspec's C decoder is not (libFuzzer still sees its inputs and the Python paths around it).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports(include=["kvfsm"]):
    from kvfsm.cli.scenario import ScenarioError, load_scenario
    from kvfsm.layout import KvGeometry
    from kvfsm.sidechannel import (
        HandshakeAccepted,
        HandshakePayload,
        HandshakeRefused,
        HandshakeRequest,
        SidechannelError,
        decode_reply,
        decode_request,
    )
    from kvfsm.sidechannel import encode as encode_frame
    from kvfsm.wire import (
        Cancel,
        Grant,
        Heartbeat,
        Registration,
        WireError,
        decode,
        encode,
        pack_blocks,
    )

_SCENARIOS = Path(__file__).parents[1] / "scenarios"
_FILE = Path(os.environ.get("KVFSM_FUZZ_SCRATCH", tempfile.gettempdir())) / (
    f"kvfsm-atheris-{os.getpid()}.toml"
)  # where the scenario target writes each input (libFuzzer exits without cleaning up)


def _wire(data: bytes) -> None:
    try:
        message = decode(data)
    except WireError:
        return
    if encode(decode(encode(message))) != encode(message):
        raise AssertionError(f"{message!r} does not re-encode to itself")


def _request(data: bytes) -> None:
    try:
        request = decode_request(data)
    except SidechannelError:
        return
    if decode_request(encode_frame(request)) != request:
        raise AssertionError(f"{request!r} does not re-encode to itself")


def _reply(data: bytes) -> None:
    try:
        reply = decode_reply(data)
    except SidechannelError:
        return
    if decode_reply(encode_frame(reply)) != reply:
        raise AssertionError(f"{reply!r} does not re-encode to itself")


def _scenario(data: bytes) -> None:
    _FILE.write_bytes(data)
    try:
        load_scenario(_FILE)
    except ScenarioError as exc:
        if not str(exc).startswith(f"{_FILE}: "):
            raise AssertionError(f"the error does not name the file: {exc}") from exc


def _seeds(target: str) -> list[bytes]:
    if target == "scenario":
        return [path.read_bytes() for path in sorted(_SCENARIOS.glob("*.toml"))]
    common: dict[str, Any] = {
        "request_id": "r-0123abcd",
        "sender_request_id": "s",
        "rank": 0,
        "tp_size": 2,
    }
    if target == "wire":
        blocks = pack_blocks([1, 2, 3])
        return [
            encode(Registration(**common, engine_id="D", block_ids=blocks, deadline=9.5)),
            encode(Grant(**common, block_ids=blocks, deadline=1.0)),
            encode(Cancel(**common, contact="127.0.0.1:5555")),
            encode(Heartbeat(request_ids=["a", "b"], rank=1)),
        ]
    request = HandshakeRequest(agent="prefill#0", wire_version=1, compat_hash="ab" * 32)
    if target == "request":
        return [encode_frame(request)]
    g = KvGeometry(
        num_layers=2, num_kv_heads=4, head_dim=4, dtype_bytes=2, block_size=4, num_blocks=8
    )
    payload = HandshakePayload(
        engine_id="prefill",
        agent="prefill#0",
        agent_metadata=b"meta",
        geometry=g,
        base_addresses=(4096, 1 << 20),
        block_lens=(g.block_len,) * 2,
        mode="push",
        wire_version=1,
        compat_hash="ab" * 32,
    )
    return [
        encode_frame(HandshakeAccepted(payload, 1.0, 2.0)),
        encode_frame(HandshakeRefused("no")),
    ]


TARGETS: dict[str, Callable[[bytes], None]] = {
    "wire": _wire,
    "request": _request,
    "reply": _reply,
    "scenario": _scenario,
}


def main() -> None:
    """Run libFuzzer on the target named by the first argument."""
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(TARGETS)}}} [libFuzzer options] [CORPUS ...]")
    target, args = sys.argv[1], sys.argv[2:]
    corpora = [Path(a) for a in args if not a.startswith("-")]
    if not corpora:  # libFuzzer keeps what it finds in the first corpus directory
        corpora = [Path(tempfile.mkdtemp(prefix=f"kvfsm-{target}-corpus-"))]
        args.append(str(corpora[0]))
    corpora[0].mkdir(parents=True, exist_ok=True)
    if not any(corpora[0].iterdir()):  # a new corpus starts from valid encodings
        for i, seed in enumerate(_seeds(target)):
            (corpora[0] / f"seed-{i}").write_bytes(seed)
    atheris.Setup([sys.argv[0], *args], TARGETS[target])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
