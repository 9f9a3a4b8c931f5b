"""``ServerConfig``: the OpenAI-compatible server's own settings (``atlas-vlm serve``): the
address, the API key, admission, request limits, the files / batches / responses stores and
the logs. The engine's settings are the ``EngineConfig``; ``run_server(engine_config,
server_config)`` takes both.

Scope: validated on creation (the messages name the ``serve`` flag); every field is a
``serve`` flag (``atlas_vlm.config.cli``), its docstring the help.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atlas_vlm.config.cli import flag

FILES = "files and batches (/v1/files, /v1/batches, /v1/responses)"
LOGS = "logs"


@dataclass
class ServerConfig:
    """The server's settings (flag names follow ``vllm serve``).

    Raises:
        ValueError: on creation, a field out of range (the message names its flag).
    """

    host: str = "127.0.0.1"
    """Bind address."""
    port: int = 8000
    """TCP port."""
    served_model_name: list[str] | None = None
    """Model name(s) clients use, the first one in responses; None: a file's stem or a folder's name,
    lower-cased (a Hub id as given); the MODEL path is also accepted in requests."""
    api_key: str | None = None
    """Require 'Authorization: Bearer KEY' on /v1/* (else 401)."""
    max_waiting_requests: int | None = None
    """Answer 503 while this many requests wait; None: no limit."""
    allowed_local_media_path: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """Allow image_url / video_url file:// URLs and paths under this folder; None: no local files."""
    max_request_body_bytes: int | None = field(default=None, metadata=flag(bytes=True))
    """413 for a larger request body; None: one --max-image-bytes image as base64 + 1MiB."""
    max_prompts_per_request: int = 64
    """/v1/completions: prompts in one call at most."""
    protect_docs_metrics: bool = False
    """With --api-key: also require the key on /docs, /redoc, /openapi.json and /metrics."""
    input_workers: int = 2
    """Threads that tokenize and preprocess images off the engine thread."""
    shutdown_timeout_s: float = field(default=30.0, metadata=flag(name="shutdown-timeout"))
    """Seconds to wait on SIGTERM for open connections and the engine's current step."""
    files_dir: str | None = field(default=None, metadata=flag(metavar="DIR", group=FILES))
    """Keep uploaded files and batch results in this folder, listed again after a restart; None: a
    temporary directory removed when the server stops."""
    max_file_bytes: int = field(default=200 * 10**6, metadata=flag(bytes=True, group=FILES))
    """Largest file accepted by POST /v1/files (413 above)."""
    responses_dir: str | None = field(default=None, metadata=flag(metavar="DIR", group=FILES))
    """Keep /v1/responses' stored responses as files in this folder, found again after a restart;
    None: in memory."""
    max_stored_responses: int = field(default=1024, metadata=flag(group=FILES))
    """Stored responses kept at most, the oldest dropped first."""
    max_batch_concurrency: int = field(default=16, metadata=flag(group=FILES))
    """Lines of one batch running at once, alongside live requests."""
    log_level: str = field(default="info", metadata=flag(choices=("debug", "info", "warning", "error"), group=LOGS))
    """Least severe log lines written (info: startup, access and engine lines)."""
    access_log: bool = field(default=True, metadata=flag(group=LOGS))
    """One access line per request (route, status, tokens, time to first token, total time, id)."""
    log_stats_interval_s: float = field(default=10.0, metadata=flag(name="log-stats-interval", metavar="S",
                                                                     group=LOGS))
    """Seconds between the engine lines (tok/s, running / waiting, KV usage, prefix-cache hit rate)
    while busy; 0: none."""

    def __post_init__(self) -> None:
        for name in ("max_prompts_per_request", "input_workers", "max_file_bytes", "max_batch_concurrency",
                     "max_stored_responses"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.log_stats_interval_s < 0:
            raise ValueError(f"--log-stats-interval must be >= 0 seconds (0: no engine lines), "
                             f"got {self.log_stats_interval_s}")
        if self.shutdown_timeout_s <= 0:
            raise ValueError(f"--shutdown-timeout must be > 0 seconds, got {self.shutdown_timeout_s}")
