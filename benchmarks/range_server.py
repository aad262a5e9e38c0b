"""A local object store for the benchmarks: serves a folder over HTTP/1.1 on 127.0.0.1 as S3 or a
CDN does (keep-alive, ``Range: bytes=A-B`` answered 206, ``HEAD`` with the size and an ETag), in a
process of its own so that its CPU is not counted as the loader's.

    python benchmarks/range_server.py FOLDER PORT
"""

from __future__ import annotations

import http.server
import os
import re
import sys

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # (connections kept alive)
    disable_nagle_algorithm = True  # (the head and the body: no 40 ms wait between them)

    def log_message(self, *args) -> None:  # (quiet)
        pass

    def _found(self) -> tuple[str, int] | None:
        path = os.path.join(self.server.folder, self.path.split("?", 1)[0].lstrip("/"))
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return path, os.path.getsize(path)

    def _etag(self, path: str) -> str:
        st = os.stat(path)
        return f'"{st.st_size:x}-{st.st_mtime_ns:x}"'  # (another object, another tag)

    def _head(self, status: int, path: str, size: int, length: int, lo: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", self._etag(path))
        if status == 206:
            self.send_header("Content-Range", f"bytes {lo}-{lo + length - 1}/{size}")
        self.end_headers()

    def do_HEAD(self) -> None:
        found = self._found()
        if found:
            self._head(200, found[0], found[1], found[1], 0)

    def do_GET(self) -> None:
        found = self._found()
        if not found:
            return
        path, size = found
        m = _RANGE.match(self.headers.get("Range", ""))
        lo, hi = (int(m[1]), min(int(m[2]) + 1 if m[2] else size, size)) if m else (0, size)
        if hi <= lo and size:  # (a range past the end, as S3 answers it)
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._head(206 if m else 200, path, size, hi - lo, lo)
        with open(path, "rb") as f:
            f.seek(lo)
            self.wfile.write(f.read(hi - lo))


def main() -> None:
    folder, port = sys.argv[1], int(sys.argv[2])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), RangeHandler)
    server.folder, server.daemon_threads = folder, True
    server.serve_forever()


if __name__ == "__main__":
    main()
