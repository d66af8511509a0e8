"""A GCS emulator on 127.0.0.1 for ``gs://`` without Google Cloud: the tests' and the bench's.

It runs gcp-storage-emulator (real HTTP, in memory) and points this process and
every process it starts at it: google-cloud-storage (``STORAGE_EMULATOR_HOST``),
TensorStore (``TENSORSTORE_GCS_HTTP_URL``, used by Orbax), ArrayRecord's reader
(``CLOUD_STORAGE_EMULATOR_ENDPOINT``) and gcsfs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# gcp-storage-emulator ignores an upload's ``ifGenerationMatch``, so two writers of one write-once object (the run
# lock's next generation) could both win, as they cannot on GCS: two agents then both led the job.  An upload whose
# precondition fails gets GCS's 412.  The emulator serves one request at a time, so the check and the write are one.
PRECONDITIONS = """
from http import HTTPStatus as _Status
from gcp_storage_emulator import server as _server
from gcp_storage_emulator.exceptions import NotFound as _NotFound
from gcp_storage_emulator.handlers import objects as _objects

def _target(request, storage):
    if "upload_id" in request.query:
        return storage.get_resumable_file_obj(request.query["upload_id"][0])["name"]
    if "name" in request.query:
        return request.query["name"][0]
    data = request.data
    return (data.get("meta") or data).get("name") if isinstance(data, dict) else None

def _preconditioned(handler):
    def checked(request, response, storage, *args, **kwargs):
        want = request.query.get("ifGenerationMatch")
        if want:
            request.data  # the body is read before any answer
            try:
                name = _target(request, storage)
                have = str(storage.get_file_obj(request.params["bucket_name"], name)["generation"])
            except (_NotFound, KeyError, TypeError):
                have = "0"
            if have != want[0]:
                response.status = _Status.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                return None
        return handler(request, response, storage, *args, **kwargs)
    return checked

_wrapped = {h: _preconditioned(h) for h in (_objects.insert, _objects.upload_partial)}
for _regex, _methods in _server.HANDLERS:
    for _m, _h in list(_methods.items()):
        if _h in _wrapped:
            _methods[_m] = _wrapped[_h]
_objects.insert, _objects.upload_partial = _wrapped[_objects.insert], _wrapped[_objects.upload_partial]
"""
# The emulator serves one request at a time from a listen queue of 5 (http.server's default): a job's
# many clients overflow it, and each dropped connection waits out TCP's SYN retries (1 s, 3 s, 7 s, ...).
# A queue of 1024 keeps them waiting in line instead.
# Each change of an object also writes the metadata of every object it holds to a file (.meta) as indented JSON:
# in memory, where nothing reads that back, it is skipped.  Otherwise a write's cost grows with the objects held
# (17 ms a write at 500, 190 ms at 2,000), and Orbax's many-object saves queue a lease's refresh for tens of seconds.
QUICKER = (
    "import socketserver\n"
    "socketserver.TCPServer.request_queue_size = 1024\n"
    "from gcp_storage_emulator.storage import Storage\n"
    "_meta = Storage._write_config_to_file\n"
    "Storage._write_config_to_file = lambda self: None if self._use_memory_fs else _meta(self)\n"
    + PRECONDITIONS
)
_LAUNCH = QUICKER + "import sys\nfrom gcp_storage_emulator.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"


@contextmanager
def gcs_emulator(bucket: str) -> Iterator[str]:
    """Run an emulator holding an empty ``bucket`` while the block runs; yields its URL."""
    port = _free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"gcs-emulator-{port}.log", "ab")
    args = ["start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "-q"]
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, *args], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"the GCS emulator did not start; see {log.name}") from None
            time.sleep(0.2)
    env = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,  # ArrayRecord's own GCS reader (a dataset read in place)
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "GOOGLE_CLOUD_PROJECT": "local",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        from training.storage import gcs_client

        gcs_client().create_bucket(bucket)  # type: ignore[attr-defined]
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
