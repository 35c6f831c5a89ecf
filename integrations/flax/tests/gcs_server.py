"""A GCS server on 127.0.0.1 for the bucket tests: ``gcp-storage-emulator`` made faithful.

The emulator (pure Python, in memory) serves GCS's JSON API but leaves out two things real
GCS does and that checkpoints rely on:

- the ``x-goog-generation`` header on downloads, which TensorStore's OCDBT reads to update a
  manifest it has read (without it: "Malformed StorageGeneration" once a step has more than
  a few arrays);
- the ``ifGenerationMatch`` / ``ifGenerationNotMatch`` preconditions, which make the writer
  lock's create atomic (``ifGenerationMatch=0``: only if absent) and TensorStore's
  read-modify-write safe.

This wraps its object handlers with both, and serves. Usage: ``gcs_server.py PORT``.
"""

import http
import sys
import threading

from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects
from gcp_storage_emulator.storage import Storage

_request = threading.local()  # the upload's preconditions, read where the object is created
_download, _insert = objects.download, objects.insert


def _generation(storage, bucket: str, name: str) -> str | None:
    try:
        return storage.get_file_obj(bucket, name)["generation"]
    except NotFound:
        return None


def _failed(query: dict, generation: str | None) -> http.HTTPStatus | None:
    """The status a precondition gives against the object's current generation, if any."""
    match = query.get("ifGenerationMatch", [None])[0]
    if match is not None and (generation or "0") != match:
        return http.HTTPStatus.PRECONDITION_FAILED
    not_match = query.get("ifGenerationNotMatch", [None])[0]
    if not_match is not None and generation == not_match:
        return http.HTTPStatus.NOT_MODIFIED
    return None


def download(request, response, storage, *args, **kwargs):
    generation = _generation(storage, request.params["bucket_name"], request.params["object_id"])
    if generation is not None:
        status = _failed(request.query, generation)
        if status is not None:
            response.status = status
            return
        response["x-goog-generation"] = generation
        response["x-goog-metageneration"] = "1"
    return _download(request, response, storage, *args, **kwargs)


def insert(request, response, storage, *args, **kwargs):
    _request.query = request.query
    try:
        return _insert(request, response, storage, *args, **kwargs)
    except _PreconditionFailed:
        response.status = http.HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412, "message": "conditionNotMet"}})
    finally:
        _request.query = {}


class _PreconditionFailed(Exception):
    pass


def _guard(create_file):
    def create(self, bucket, name, content, file_obj, *args, **kwargs):
        query = getattr(_request, "query", {})
        if _failed(query, _generation(self, bucket, name)) is not None:
            raise _PreconditionFailed
        return create_file(self, bucket, name, content, file_obj, *args, **kwargs)

    return create


def main(port: int) -> None:
    wrapped = {_download: download, _insert: insert}
    objects.download = download  # ``get`` with ``alt=media`` calls it by its module name
    server.HANDLERS = tuple(
        (regex, {method: wrapped.get(handler, handler) for method, handler in handlers.items()})
        for regex, handlers in server.HANDLERS
    )
    Storage.create_file = _guard(Storage.create_file)
    server.create_server("127.0.0.1", port, in_memory=True).run()


if __name__ == "__main__":
    main(int(sys.argv[1]))
