"""The grammar compile server: a process of its own per front end, which forks a child for
every compile, so that a compile past its budget is killed, not left to burn a core.

Why: xgrammar's compiles cannot be interrupted (no timeout or cancel in its API), and a
hostile schema within every size limit can still take a minute (compile time grows about
cubically with nesting). In a thread it runs on to its end after its request was refused; in
a child process it ends with SIGKILL the moment its budget runs out.

Why fork from here: starting a process with xgrammar costs ~2 s and ~300 MiB (it imports
torch and transformers); this server pays that once, builds the tokenizer's vocabulary once
(`TokenizerInfo`), and each child is a copy-on-write fork that starts compiling within
~20 ms (measured: fork, compile of a 30-property schema and reply in 27 ms). The front end
itself is never forked: it runs gRPC's threads.

The front end (scheduler_svc.frontend.compile_process) speaks to it over its stdin and
stdout, in frames: a 4-byte little-endian length, then one msgspec struct in MessagePack
(never pickle; sizes bounded, every field typed and checked on decoding):

    front end -> server                       server -> front end
    Init(tokenizer, vocab_size, stop_ids)     Ready(vocabulary) | Failed(error)
    Compile(job, kind, text)                  Done(job, grammar) | Error(job, error)
    Cancel(job)                               Cancelled(job)

`kind`: "json_schema", "regex" or "grammar" (EBNF from rule `root`); `vocabulary` and
`grammar` are xgrammar's serialized JSON, as the engine cores take them. The server exits when
its stdin closes (its front end is gone), killing its children first; a child dies with it.
"""

import os
import selectors
import signal
import struct
import sys
from typing import Annotated, BinaryIO, Literal

import msgspec
from msgspec import Meta

MAX_REQUEST_BYTES = 64 << 20      # a frame to the server: a tokenizer.json is the largest
MAX_REPLY_BYTES = 512 << 20       # a frame from it: a compiled grammar of a large vocabulary
MAX_CHILDREN = 16                 # compiles at once (the front end's pool asks for fewer)
CHILD_NICENESS = 10               # below the services' own processes: a compile burns a core
_LENGTH = struct.Struct("<I")

Job = Annotated[int, Meta(ge=0, lt=1 << 62)]
Text = Annotated[str, Meta(max_length=MAX_REQUEST_BYTES)]
Reason = Annotated[str, Meta(max_length=1 << 16)]


class _Frame(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    """Base of the server's messages: positional, tagged with the class name."""


class Init(_Frame, frozen=True):
    tokenizer: Text                       # the tokenizers library's JSON of the tokenizer
    vocab_size: Annotated[int, Meta(ge=1, lt=1 << 31)]
    stop_ids: Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 31)]], Meta(max_length=1024)]


class Compile(_Frame, frozen=True):
    job: Job
    kind: Literal["json_schema", "regex", "grammar"]
    text: Text


class Cancel(_Frame, frozen=True):
    job: Job


class Ready(_Frame, frozen=True):
    vocabulary: bytes                     # xgrammar's TokenizerInfo, serialized


class Failed(_Frame, frozen=True):
    error: Reason


class Done(_Frame, frozen=True):
    job: Job
    grammar: bytes                        # xgrammar's CompiledGrammar, serialized


class Error(_Frame, frozen=True):
    job: Job
    error: Reason


class Cancelled(_Frame, frozen=True):
    job: Job


ToServer = Init | Compile | Cancel
FromServer = Ready | Failed | Done | Error | Cancelled
_encoder = msgspec.msgpack.Encoder()


class FrameError(ValueError):
    """A frame that is malformed or too large."""


def encode_frame(message: _Frame) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def decode_body(body: bytes, decoder: "msgspec.msgpack.Decoder[_Frame]") -> _Frame:
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"undecodable frame: {exc}") from None


def read_frame(stream: BinaryIO, max_bytes: int,
               decoder: "msgspec.msgpack.Decoder[_Frame]") -> _Frame | None:
    """The next frame from a blocking stream; None at a clean end of stream."""
    head = _read_exactly(stream, _LENGTH.size)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > max_bytes:
        raise FrameError(f"frame of {size} bytes; at most {max_bytes}")
    body = _read_exactly(stream, size)
    if body is None:
        raise FrameError("stream ended inside a frame")
    return decode_body(body, decoder)


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            if left == size:
                return None
            raise FrameError("stream ended inside a frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def compile_reason(exc: BaseException) -> str:
    """xgrammar's error, without the time and C++ source location it prefixes."""
    reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
    head, sep, rest = reason.partition(".cc:")
    if sep and ": " in rest:
        return rest.split(": ", 1)[1]
    return reason


class Server:
    """The server's state: the vocabulary and the children compiling (by pipe fd)."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.info: object = None                               # xgrammar.TokenizerInfo
        self.children: dict[int, tuple[int, int]] = {}     # pipe fd -> (job, pid)
        self.by_job: dict[int, int] = {}                   # job -> pipe fd
        self.replies: dict[int, bytearray] = {}            # pipe fd -> what it wrote so far
        self.selector = selectors.DefaultSelector()

    def send(self, message: _Frame) -> None:
        self.out.write(encode_frame(message))
        self.out.flush()

    def init(self, message: Init) -> None:
        try:
            import tokenizers
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            fast = PreTrainedTokenizerFast(
                tokenizer_object=tokenizers.Tokenizer.from_str(message.tokenizer))
            self.info = xgr.TokenizerInfo.from_huggingface(
                fast, vocab_size=message.vocab_size, stop_token_ids=message.stop_ids)
        except Exception as exc:      # its message goes to the front end, which raises it
            self.send(Failed(f"{type(exc).__name__}: {exc}"[:1000]))
            return
        self.send(Ready(self.info.serialize_json().encode()))

    def compile(self, message: Compile) -> None:
        job, kind, text = message.job, message.kind, message.text
        if self.info is None or job in self.by_job:
            self.send(Error(job, "not initialized" if self.info is None else "job id in use"))
            return
        if len(self.children) >= MAX_CHILDREN:
            self.send(Error(job, f"more than {MAX_CHILDREN} compiles at once"))
            return
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:                                   # the child: compile, reply, exit
            os.close(read_fd)
            _child(self.info, job, kind, text, write_fd)    # never returns
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        self.children[read_fd] = (job, pid)
        self.by_job[job] = read_fd
        self.replies[read_fd] = bytearray()
        self.selector.register(read_fd, selectors.EVENT_READ, "child")

    def cancel(self, message: Cancel) -> None:
        job = message.job
        fd = self.by_job.get(job)
        if fd is None:
            return                     # it ended already; its reply went out
        pid = self.children[fd][1]
        os.kill(pid, signal.SIGKILL)
        self._forget(fd)
        os.waitpid(pid, 0)
        self.send(Cancelled(job))

    def child_readable(self, fd: int) -> None:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return
        if chunk:
            self.replies[fd] += chunk
            if len(self.replies[fd]) > MAX_REPLY_BYTES + _LENGTH.size:
                os.kill(self.children[fd][1], signal.SIGKILL)
            return
        job, pid = self.children[fd]
        reply = bytes(self.replies[fd])
        self._forget(fd)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and len(reply) >= _LENGTH.size:
            self.out.write(reply)      # the child's frame, passed on as it is
            self.out.flush()
            return
        if os.WIFSIGNALED(status):
            why = f"the compiler died of {signal.Signals(os.WTERMSIG(status)).name}"
        else:
            why = f"the compiler exited with status {os.waitstatus_to_exitcode(status)}"
        self.send(Error(job, why))

    def _forget(self, fd: int) -> None:
        job, _ = self.children.pop(fd)
        del self.by_job[job]
        del self.replies[fd]
        self.selector.unregister(fd)
        os.close(fd)

    def kill_children(self) -> None:
        for fd, (_, pid) in list(self.children.items()):
            os.kill(pid, signal.SIGKILL)
            self._forget(fd)
            os.waitpid(pid, 0)


def _child(info: object, job: int, kind: str, text: str, write_fd: int) -> None:
    """A forked child's whole life: one compile, one frame to `write_fd`, `os._exit`."""
    code = 1
    try:
        # Not the server's stdin and stdout: its front end must see the server's end at
        # once, not when the last child ends; and the child dies with the server.
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        _die_with_parent()
        os.nice(CHILD_NICENESS)
        import xgrammar as xgr

        # Its own compiler: one thread, no cache (a child's cache would die with it).
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            compiled = (compiler.compile_json_schema(text) if kind == "json_schema" else
                        compiler.compile_regex(text) if kind == "regex" else
                        compiler.compile_grammar(text))
            reply: _Frame = Done(job, compiled.serialize_json().encode())
        except RuntimeError as exc:    # xgrammar's parse and conversion errors
            reply = Error(job, compile_reason(exc)[:1000])
        frame = memoryview(encode_frame(reply))
        while frame:
            frame = frame[os.write(write_fd, frame):]
        code = 0
    finally:
        os._exit(code)


def _die_with_parent() -> None:
    """SIGKILL when the server dies (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """Answers frames from `inp` until it ends."""
    server = Server(out)
    os.set_blocking(inp.fileno(), False)
    server.selector.register(inp.fileno(), selectors.EVENT_READ, "input")
    pending = bytearray()
    decoder = msgspec.msgpack.Decoder(ToServer)
    try:
        while True:
            for key, _ in server.selector.select():
                if key.data == "child":
                    server.child_readable(key.fd)
                    continue
                try:
                    chunk = os.read(key.fd, 1 << 20)
                except BlockingIOError:
                    continue
                if not chunk:
                    return
                pending += chunk
                while len(pending) >= _LENGTH.size:
                    (size,) = _LENGTH.unpack_from(pending)
                    if size > MAX_REQUEST_BYTES:
                        raise FrameError(f"frame of {size} bytes; at most {MAX_REQUEST_BYTES}")
                    if len(pending) < _LENGTH.size + size:
                        break
                    body = bytes(pending[_LENGTH.size:_LENGTH.size + size])
                    del pending[:_LENGTH.size + size]
                    message = decode_body(body, decoder)
                    if isinstance(message, Init):
                        server.init(message)
                    elif isinstance(message, Compile):
                        server.compile(message)
                    else:
                        server.cancel(message)      # type: ignore[arg-type]
    finally:
        server.kill_children()


def main() -> None:
    # Its own front end is its only client, over pipes; a malformed frame is a bug there,
    # and ends the server with the reason on stderr (the front end starts a new one).
    try:
        serve(sys.stdin.buffer, sys.stdout.buffer)
    except FrameError as exc:
        print(f"compile server: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
