"""Connection limits under uvicorn: a connection must finish each request's headers within
`header_timeout_s` of opening (or of its previous response), in at most `max_header_bytes`, else it is
closed (431 for oversized headers). Idle keep-alive connections close after uvicorn's keep-alive
timeout. Without this, an idle socket or a client dribbling one header byte a second held its
descriptor for ever, and a huge header took seconds to refuse."""
from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def guarded_protocol(header_timeout_s: float, max_header_bytes: int) -> type[HttpToolsProtocol]:
    class GuardedHttp(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._header_bytes = 0

        def _arm(self) -> None:
            self._disarm()
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            reading_headers = self._header_timer is not None
            super().data_received(data)  # may complete the headers (and disarm) within this chunk
            if reading_headers and self._header_timer is not None:
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes and not self.transport.is_closing():
                    self._disarm()
                    self._refuse()

        def _refuse(self) -> None:
            msg = b'{"error": "request headers larger than %d bytes", "error_type": "headers_too_large"}' % (
                max_header_bytes)
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(msg), msg))
            self.transport.close()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this keep-alive connection gets the same limits

    return GuardedHttp
