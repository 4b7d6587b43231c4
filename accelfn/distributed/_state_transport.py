"""How a replica group's live TrainState reaches a group that heals from it: torchft's
``CheckpointTransport`` over HTTP, carrying bytes, never pickles.

torchft's own transports unpickle what they receive (its HTTP transport with
``weights_only=False``; its process-group transport its metadata). Here the donor serves,
for the step the quorum named, one body: an 8-byte little-endian header length, a JSON
header (torchft's own counters, and the name and length of each part of the user's state
dict), then each part's raw bytes. Every part is a ``uint8`` tensor: the state packed by
``distributed.fault_tolerance.StateTransfer`` (accelfn's checkpoint format in memory: JSON
and raw tensor bytes, decoded and verified by the receiver). torchft imports this module
only where ``tolerate_faults`` runs (torchft is optional).
"""

from __future__ import annotations

import socket
import struct
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
import torch
from torchft.checkpointing import CheckpointTransport


class StateServer(ThreadingHTTPServer):
    """An HTTP server on every interface (IPv6 and IPv4 where the machine has both)."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        try:
            self.address_family = socket.AF_INET6
            super().__init__(("::", 0), handler, bind_and_activate=False)
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        except OSError:  # no IPv6 here
            self.address_family = socket.AF_INET
            super().__init__(("0.0.0.0", 0), handler, bind_and_activate=False)  # noqa: S104 (other machines' groups)
        try:
            self.server_bind()
            self.server_activate()
        except BaseException:
            self.server_close()
            raise


def encode(state_dict: dict[str, Any]) -> bytes:
    """torchft's ``{"user": {key: uint8 tensor}, "torchft": {...}}`` as one body (module doc).

    Raises:
        TypeError: a part of the user's state dict that is not a uint8 tensor.
    """
    parts = []
    for key, value in state_dict["user"].items():
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
            raise TypeError(f"the state sent to a healing replica group must be packed into uint8 tensors; {key!r} "
                            f"is a {type(value).__name__}")
        parts.append((key, value.contiguous().numpy().tobytes()))
    header = orjson.dumps({"torchft": state_dict["torchft"], "user": [[key, len(data)] for key, data in parts]})
    return b"".join([struct.pack("<Q", len(header)), header, *(data for _, data in parts)])


def decode(body: bytes) -> dict[str, Any]:
    """The state dict ``encode`` wrote.

    Raises:
        ValueError: a body that is not one (truncated, or lengths that do not add up).
    """
    if len(body) < 8:
        raise ValueError(f"the replica group's state is {len(body)} bytes long, too short for its header")
    (length,) = struct.unpack_from("<Q", body)
    header = orjson.loads(body[8:8 + length])
    user, offset = {}, 8 + length
    for key, size in header["user"]:
        if offset + size > len(body):
            raise ValueError(f"the replica group's state ends after {len(body)} bytes, inside its part {key!r}")
        user[key] = torch.frombuffer(bytearray(body[offset:offset + size]), dtype=torch.uint8)
        offset += size
    if offset != len(body):
        raise ValueError(f"the replica group's state has {len(body) - offset} bytes after its last part")
    return {"user": user, "torchft": header["torchft"]}


class StateTransport(CheckpointTransport[dict[str, Any]]):
    """torchft's ``CheckpointTransport`` for ``tolerate_faults``: serves this group's state for
    the step a quorum asks for, and fetches another group's (module doc).

    Args:
        host: the name other groups reach this machine by (in the address it advertises).
        timeout_s: how long a fetch, or a request waiting for its step to be staged, may take.
    """

    def __init__(self, host: str, timeout_s: float):
        self._host = host
        self._timeout_s = timeout_s
        self._staged: tuple[int, bytes] | None = None
        self._ready = threading.Condition()
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = timeout_s

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != "state" or not parts[1].isdigit():
                    self.send_error(400, f"expected /state/STEP, got {self.path}")
                    return
                body = transport._wait_for(int(parts[1]))
                if body is None:
                    self.send_error(404, f"no state staged for step {parts[1]}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                return  # no line on stderr per request

        self._server = StateServer(Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="accelfn-state-transport",
                                        daemon=True)
        self._thread.start()

    def _wait_for(self, step: int) -> bytes | None:
        with self._ready:
            self._ready.wait_for(lambda: self._staged is not None and self._staged[0] == step,
                                 timeout=self._timeout_s)
            staged = self._staged
        return staged[1] if staged is not None and staged[0] == step else None

    def metadata(self) -> str:
        """``http://HOST:PORT/state/``: where a healing group fetches this group's state."""
        return f"http://{self._host}:{self._server.server_address[1]}/state/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any],
                        timeout: timedelta) -> None:
        """Stages ``state_dict`` (encoded at once: later changes to the state do not reach it)."""
        body = encode(state_dict)
        with self._ready:
            self._staged = (step, body)
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        """Drops the staged state (torchft calls it once the update is decided)."""
        with self._ready:
            self._staged = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        """The state group ``src_rank`` staged for ``step``, fetched from its ``metadata`` address.

        Raises:
            ConnectionError: the donor did not answer, or answered with an error.
            ValueError: a body that does not decode.
        """
        try:
            with urllib.request.urlopen(f"{metadata}{step}", timeout=timeout.total_seconds()) as response:  # noqa: S310 (http only)
                body = response.read()
        except (urllib.error.URLError, OSError) as e:
            raise ConnectionError(f"fetching replica group {src_rank}'s state for step {step} from {metadata}: "
                                  f"{e}") from e
        return decode(body)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()
