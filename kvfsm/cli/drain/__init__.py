"""`kvfsm drain HOST:PORT`: ask an engine to drain (no new KV hand-offs; what is under way
ends; its peers are told goodbye) at its side-channel listener, and with `--wait` until it is
drained (safe to stop). `--status` only asks. The shared secret comes from
`$KVFSM_SHARED_SECRET` (or `--secret-env`), as the engines take it."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Literal

from kvfsm.cli._parsing import Commands
from kvfsm.sidechannel import SidechannelError, request_control
from kvfsm.wire import SharedSecret

__all__ = ["add_command"]

_POLL_S = 0.5


def add_command(commands: Commands) -> None:
    """`kvfsm drain`: drain an engine, or ask its state."""
    drain = commands.add_parser("drain", help="drain an engine (or ask its state)")
    drain.add_argument("where", metavar="HOST:PORT", help="the engine's side-channel listener")
    drain.add_argument("--status", action="store_true", help="only ask its state")
    drain.add_argument(
        "--wait", type=float, default=0.0, metavar="S", help="wait up to S seconds until drained"
    )
    drain.add_argument("--timeout", type=float, default=5.0, help="seconds per request")
    drain.add_argument("--secret-env", default="KVFSM_SHARED_SECRET", help="its variable")
    drain.set_defaults(run=_execute)


def _execute(args: argparse.Namespace) -> int:
    host, _, port = args.where.rpartition(":")
    if not host or not port.isdigit():
        print(f"kvfsm drain: {args.where!r} is not HOST:PORT", file=sys.stderr)
        return 2
    value = os.environ.get(args.secret_env, "")
    secret = SharedSecret(value) if value else None
    op: Literal["drain", "status"] = "status" if args.status else "drain"
    end = time.monotonic() + args.wait
    try:
        while True:
            reply = request_control(host, int(port), op, secret=secret, timeout_s=args.timeout)
            op = "status"
            if reply.state != "draining" or time.monotonic() >= end:
                break
            time.sleep(_POLL_S)
    except SidechannelError as exc:
        print(f"kvfsm drain: {exc}", file=sys.stderr)
        return 2
    print(reply.state + (f": {reply.detail}" if reply.detail else ""))
    if reply.state == "refused":
        return 2
    return 0 if reply.state == "drained" or not args.wait else 1
