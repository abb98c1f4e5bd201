"""Every version of one object as the API server's watch delivers it, for a test to look back on.

A status that lasts one operator round (a service's `status.arbitration` in the round that drains its preempted
replicas, cleared when its next round asks only for what it holds) is gone between two polls of `kubectl get`
(0.1-1 s each on a loaded machine); a watch delivers every write. Data flow: `ObjectWatch(cp, ns, kind, name)`
-> `kubectl get -w -o json` (a stream of JSON documents) -> a reader thread decoding each -> `versions`;
`values(path)` the non-empty values of a field over them, in order; `stop()` ends kubectl.
"""

from __future__ import annotations

import json
import subprocess
import threading
from typing import Any

from kascade_devcluster.controlplane import ControlPlane


class ObjectWatch:
    def __init__(self, cp: ControlPlane, ns: str, kind: str, name: str) -> None:
        self._proc = cp.kubectl_stream("-n", ns, "get", kind, name, "-w", "-o", "json")
        self._lock = threading.Lock()
        self._versions: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, name=f"watch {kind}/{name}", daemon=True)
        self._thread.start()

    @property
    def versions(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._versions)

    def values(self, *path: str) -> list[Any]:
        """The non-empty values of the field at `path` (e.g. "status", "arbitration") over every version seen."""
        out = []
        for doc in self.versions:
            v: Any = doc
            for key in path:
                v = v.get(key) if isinstance(v, dict) else None
            if v:
                out.append(v)
        return out

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._thread.join(10)

    def _read(self) -> None:
        """Decode the concatenated (pretty-printed) JSON documents kubectl writes, one per watch event."""
        dec, buf = json.JSONDecoder(), ""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            buf += line
            if not line.startswith("}"):  # a document ends with a closing brace in column 0
                continue
            while True:
                buf = buf.lstrip()
                try:
                    doc, end = dec.raw_decode(buf)
                except json.JSONDecodeError:
                    break  # incomplete: more lines to come
                buf = buf[end:]
                with self._lock:
                    self._versions.append(doc)
