"""What `kvfsm demo` and `kvfsm bench` do when they cannot run: buffers too large for the host
are refused before any process starts, and a process that dies is reported at once, in one
line, without a hang or a second traceback from the clean-up."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from kvfsm.bench import recv_bounded
from kvfsm.cli import main
from kvfsm.harness import RankProcesses, available_memory, require_memory


def test_the_host_reports_its_available_memory() -> None:
    have = available_memory()
    assert have is None or have > 0


def test_require_memory_names_the_need_the_host_and_the_remedy() -> None:
    require_memory(2**30, "one buffer", "use less", available=2**31)  # fits: no error
    with pytest.raises(
        ValueError, match=r"one buffer need 2\.0 GiB .* 1\.0 GiB available: use less"
    ):
        require_memory(2**31, "one buffer", "use less", available=2**30)


def test_bench_refuses_buffers_larger_than_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    # 4 PiB per side: no host has it, so the refusal comes before any process is started.
    status = main(["bench", "--block-kib", str(2**20), "--blocks", str(2**20), "--regions", "4"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("kvfsm bench: three KV buffers of") and "--block-kib" in err


def test_demo_refuses_caches_larger_than_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    have = available_memory()
    need = 2 * 128 * 2**30  # the llama3-8b geometry caps a rank at 65,536 blocks: 128 GiB
    if have is None or have >= need:
        pytest.skip("this host has the memory (or does not say how much)")
    status = main(["demo", "--memory-mib", str(2**30), "--requests", "1"])
    assert status == 2
    err = capsys.readouterr().err
    # The block cap sized the caches, not the flag: said first, then the refusal.
    assert "a rank's cache holds 8 to 65,536 blocks" in err
    assert "2 rank KV caches of 128.00 GiB at most need 256.0 GiB" in err


def test_a_bench_process_that_dies_is_reported_at_once() -> None:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=os._exit, args=(3,), name="bench target")
    proc.start()
    with pytest.raises(RuntimeError, match="bench target exited with code 3"):
        recv_bounded(conn, "target", [proc])
    child.close()


def test_a_message_sent_before_the_process_exits_is_still_taken() -> None:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=child.send, args=(("ok", 1),), name="bench initiator")
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert recv_bounded(conn, "initiator", [proc]) == ("ok", 1)


def test_the_demo_stops_cleanly_around_a_rank_that_died_unread() -> None:
    # The rank exits as soon as a message arrives, without reading it (as a rank that failed
    # does when the driver's "stop" reaches it): the driver's end of the pipe is then reset,
    # which its clean-up must take as a dead rank, not raise.
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=child.poll, args=(None,), name="P#0")
    proc.start()
    child.close()  # only the rank holds its end: its exit resets the pipe
    ranks = RankProcesses()
    ranks.pipes["P#0"], ranks.procs["P#0"] = conn, proc
    assert ranks.stop() == {}
    assert proc.exitcode == 0 and not ranks.pipes
