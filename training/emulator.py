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


# gcp-storage-emulator ignores generation preconditions, and its media downloads carry no ``x-goog-generation``.
# Both matter to writers of one object who must not both win, as on GCS:
# - the run lock's write-once generations: an upload with ``ifGenerationMatch=0`` (unpatched, two racing creates
#   both won, and two agents both led the job);
# - tensorstore (Orbax's OCDBT): it reads an object's generation from a download's ``x-goog-generation`` and makes
#   its next write of that object (the manifest) conditional on it.  Unpatched it read generation 0 and refused the
#   write itself ("Malformed StorageGeneration"); a delete on a stale generation deleted the newer object.
# So, as on GCS: a download answers with the object's generation and metageneration headers; each
# ``if(Meta)generation(Not)Match`` on an upload, a read, a delete or a patch is checked, and one that fails gets
# 412 (304 for a read's ``...NotMatch``).  An upload counts a missing object as generation 0; a read, delete or patch
# of one gets the handler's 404.  Requests are handled one at a time (below), so the check and the write are one.
PRECONDITIONS = """
from http import HTTPStatus as _Status
from gcp_storage_emulator import server as _server
from gcp_storage_emulator.exceptions import NotFound as _NotFound
from gcp_storage_emulator.handlers import objects as _objects

_CONDITIONS = (("ifGenerationMatch", "generation", True), ("ifGenerationNotMatch", "generation", False),
               ("ifMetagenerationMatch", "metageneration", True), ("ifMetagenerationNotMatch", "metageneration", False))

def _target(request, storage):
    if "upload_id" in request.query:
        return storage.get_resumable_file_obj(request.query["upload_id"][0])["name"]
    if "name" in request.query:
        return request.query["name"][0]
    if "object_id" in request.params:
        return request.params["object_id"]
    data = request.data
    return (data.get("meta") or data).get("name") if isinstance(data, dict) else None

def _current(request, storage):
    try:
        return storage.get_file_obj(request.params["bucket_name"], _target(request, storage))
    except (_NotFound, KeyError, TypeError):
        return None

def _unmet(query, obj, reading):
    for param, field, equal in _CONDITIONS:
        want = query.get(param)
        have = str(obj[field]) if obj else "0"
        if want and (have == want[0]) != equal:
            return _Status.NOT_MODIFIED if reading and not equal else _Status.PRECONDITION_FAILED
    return None

def _preconditioned(handler, uploading=False, reading=False):
    def checked(request, response, storage, *args, **kwargs):
        if uploading and not any(p in request.query for p, _, _ in _CONDITIONS):
            return handler(request, response, storage, *args, **kwargs)
        if uploading:
            request.data  # the body is read before any answer
        obj = _current(request, storage)
        if obj is None and not uploading:
            return handler(request, response, storage, *args, **kwargs)
        unmet = _unmet(request.query, obj, reading)
        if unmet == _Status.PRECONDITION_FAILED:
            response.status = unmet
            response.json({"error": {"code": 412, "message": "conditionNotMet"}})
            return None
        if unmet:
            response.status = unmet
            return None
        if reading:
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj["metageneration"])
        return handler(request, response, storage, *args, **kwargs)
    return checked

_uploads = {h: _preconditioned(h, uploading=True) for h in (_objects.insert, _objects.upload_partial)}
_wrapped = {
    **_uploads,
    **{h: _preconditioned(h, reading=True) for h in (_objects.get, _objects.download)},
    **{h: _preconditioned(h) for h in (_objects.delete, _objects.patch)},
}
for _regex, _methods in _server.HANDLERS:
    for _m, _h in list(_methods.items()):
        if _h in _wrapped:
            _methods[_m] = _wrapped[_h]
# An upload reaches these by name too (a resumable upload's POST, a POST to .../o without /upload); ``get`` calls
# ``download`` by name, already checked.
_objects.insert, _objects.upload_partial = _uploads[_objects.insert], _uploads[_objects.upload_partial]
"""
# The emulator serves one connection at a time, from reading its request to sending its answer: one client stalled
# mid-request (a job's process stopped by SIGSTOP, or one that died between its headers and its body) held up every
# other client until its socket timed out.  So each connection gets a thread that reads the whole request and sends
# the answer on its own, and only the handling between them (the storage's check and write) goes one at a time.
CONCURRENT = """
import io as _io
import threading as _threading
from functools import partial as _partial
from http.server import ThreadingHTTPServer as _ThreadingHTTPServer
from gcp_storage_emulator import server as _srv

_one_at_a_time = _threading.Lock()
_read_body = _srv._read_raw_data
_srv._read_raw_data = lambda handler: handler.body

def _handled_alone(do):
    def served(self):
        self.body = _read_body(self)
        sock, self.wfile = self.wfile, _io.BytesIO()
        try:
            with _one_at_a_time:
                do(self)
        finally:
            answer, self.wfile = self.wfile.getvalue(), sock
        sock.write(answer)
    return served

for _name in ("do_GET", "do_POST", "do_PUT", "do_PATCH", "do_DELETE"):
    setattr(_srv.RequestHandler, _name, _handled_alone(getattr(_srv.RequestHandler, _name)))
_srv.RequestHandler.timeout = 600  # a client gone mid-request frees its thread

class _Server(_ThreadingHTTPServer):
    daemon_threads = True

def _run(self):
    self._httpd = _Server((self._host, self._port), _partial(_srv.RequestHandler, self._storage))
    self.is_running.set()
    self._httpd.serve_forever()

_srv.APIThread.run = _run
"""
# The listen queue is 5 by default (http.server's): a job's many clients overflowed it, and each dropped connection
# waited out TCP's SYN retries (1 s, 3 s, 7 s, ...).  A queue of 1024 keeps them waiting in line instead.
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
    + CONCURRENT
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
