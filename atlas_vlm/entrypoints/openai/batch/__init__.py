"""OpenAI's batch API: the JSONL line format and its runner (shared by ``atlas-vlm run-batch``
and ``/v1/batches``), the ``/v1/files`` store and the ``/v1/batches`` jobs."""
