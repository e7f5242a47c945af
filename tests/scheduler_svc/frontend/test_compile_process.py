"""The grammar compile server (scheduler_svc.frontend.compile_server) through its front-end
client (compile_process.CompileProcess), with the default model's tokenizer: compiles come
back as xgrammar takes them, a compile is killed on demand with its CPU, a lost server is
replaced, and a malformed frame ends the server with the reason."""

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from scheduler_svc.frontend.compile_process import (
    CompileCancelled,
    CompileFailed,
    CompileProcess,
    CompileServerLost,
)
from scheduler_svc.frontend.compile_server import MAX_REQUEST_BYTES

VOCAB = 49152


def slow_schema(num_properties: int = 300) -> str:
    """~3.4 s of compiling here (AMD EPYC, 2 cores): within every size limit."""
    names = [f"p{i}" for i in range(num_properties)]
    return json.dumps({"type": "object", "required": names,
                       "properties": {n: {"type": "string", "maxLength": 20} for n in names}})


def children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    with open(path) as f:
        return [int(p) for p in f.read().split()]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compile_in_thread(process: CompileProcess, errors: list[BaseException]) -> threading.Thread:
    """The slow schema compiling under key "slow" on a thread of its own (what a compile
    pool thread does); what it raises goes to `errors`."""
    def compile_slow() -> None:
        try:
            process.compile("slow", "json_schema", slow_schema())
        except BaseException as exc:  # noqa: BLE001 - the test checks it
            errors.append(exc)

    thread = threading.Thread(target=compile_slow)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def process(tokenizer) -> Iterator[CompileProcess]:  # type: ignore[no-untyped-def]
    p = CompileProcess(tokenizer.tokenizer.to_str(), VOCAB, [2])
    yield p
    p.close()


def test_compiles_come_back_as_xgrammar_takes_them(process: CompileProcess) -> None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(process.vocabulary().decode())
    assert info.vocab_size == VOCAB and info.stop_token_ids == [2]
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                         "required": ["n"]})
    grammar = xgr.CompiledGrammar.deserialize_json(
        process.compile("a", "json_schema", schema).decode(), info)
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string('{"n": 12}') and matcher.accept_token(2)   # then EOS
    assert matcher.is_terminated()
    assert not xgr.GrammarMatcher(grammar).accept_string('{"m"')
    regex = xgr.CompiledGrammar.deserialize_json(
        process.compile("b", "regex", "(yes|no)").decode(), info)
    assert xgr.GrammarMatcher(regex).accept_string("no")
    with pytest.raises(CompileFailed, match=r"Unclosed '\['"):
        process.compile("c", "regex", "a[")
    with pytest.raises(CompileFailed, match="root"):
        process.compile("d", "grammar", 'start ::= "x"')
    assert not children(process.pid)          # every compile's child is gone  # type: ignore[arg-type]


def test_a_cancelled_compile_is_killed_with_its_cpu(process: CompileProcess) -> None:
    process.vocabulary()
    server = process.pid
    assert server is not None
    errors: list[BaseException] = []
    thread = compile_in_thread(process, errors)
    for _ in range(200):                     # its child starts
        if children(server):
            break
        time.sleep(0.01)
    (child,) = children(server)
    time.sleep(0.5)                          # it compiles: a core's worth
    assert cpu_seconds(child) > 0.1
    start = time.monotonic()
    process.cancel("slow")
    thread.join(5)
    assert time.monotonic() - start < 0.5
    assert len(errors) == 1 and isinstance(errors[0], CompileCancelled), errors
    assert not children(server)
    assert not os.path.exists(f"/proc/{child}")   # reaped, not a zombie
    assert process.num_cancelled == 1
    # The server goes on serving; cancelling a finished compile does nothing.
    assert process.compile("after", "regex", "x+")
    process.cancel("after")
    assert process.pid == server


def test_a_lost_server_fails_its_compiles_and_is_replaced(tokenizer) -> None:  # type: ignore[no-untyped-def]
    p = CompileProcess(tokenizer.tokenizer.to_str(), VOCAB, [2])
    try:
        p.vocabulary()
        errors: list[BaseException] = []
        thread = compile_in_thread(p, errors)
        time.sleep(0.3)
        first = p.pid
        child = children(first)[0]  # type: ignore[arg-type]
        os.kill(first, signal.SIGKILL)  # type: ignore[arg-type]
        thread.join(10)
        assert len(errors) == 1 and isinstance(errors[0], CompileServerLost), errors
        for _ in range(100):                 # the child dies with its server
            if not os.path.exists(f"/proc/{child}") or _state(child) == "Z":
                break
            time.sleep(0.02)
        assert not os.path.exists(f"/proc/{child}") or _state(child) == "Z"
        assert p.compile("next", "regex", "ok")      # a new server
        assert p.num_started == 2 and p.pid != first
    finally:
        p.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_tokenizer_it_cannot_read_is_refused_with_the_reason() -> None:
    p = CompileProcess("{not a tokenizer", VOCAB, [2])
    try:
        with pytest.raises(CompileServerLost, match="could not start: .*key must be a string"):
            p.vocabulary()
    finally:
        p.close()


@pytest.mark.parametrize("frame", [
    struct.pack("<I", MAX_REQUEST_BYTES + 1),            # a length past the limit
    struct.pack("<I", 3) + b"\xc1\xc1\xc1",              # not MessagePack
    struct.pack("<I", 4) + b"\x93\xa4Nope\x01\x02"[:4],  # an unknown message
])
def test_a_malformed_frame_ends_the_server_naming_it(frame: bytes) -> None:
    server = subprocess.Popen([sys.executable, "-m", "scheduler_svc.frontend.compile_server"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    _, err = server.communicate(frame, timeout=60)
    assert server.returncode == 2
    assert b"compile server: " in err and b"Traceback" not in err, err


def test_the_server_exits_when_its_front_end_goes() -> None:
    server = subprocess.Popen([sys.executable, "-m", "scheduler_svc.frontend.compile_server"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    server.stdin.close()                                 # type: ignore[union-attr]
    assert server.wait(60) == 0
