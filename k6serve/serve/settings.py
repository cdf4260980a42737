"""The HTTP server's own settings (the engine's live in `k6serve.config`), and `settings_from_options`, which
makes them from the `k6serve serve` options."""

from __future__ import annotations

import math
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k6serve.config import flag_name
from k6serve.serve.webhook_transport import WEBHOOK_SECRET_ENV
from k6serve.serve.webhook_urls import check_webhook_url

API_KEY_ENV = "K6SERVE_API_KEY"


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 30000
    output_path: Path = Path("outputs")
    job_store: Path | None = None  # None: <output_path>/jobs.sqlite3
    output_ttl_s: float = 86400.0  # finished jobs and their files are deleted this long after finishing; 0 keeps
    max_queued_jobs: int = 64
    max_upload_mb: float = 512.0
    allowed_input_dirs: tuple[Path, ...] = ()  # empty: ./inputs (never the upload folder: InputPathPolicy)
    allowed_lora_dirs: tuple[Path, ...] = ()  # empty: set_lora reads any path and hub id (LoraPathPolicy)
    api_key: str | None = None
    # Web pages (by origin, "https://app.example.com", as `normal_origin` writes it) whose scripts may call the API
    # from a browser (CORS); "*" any page, with --api-key only. Empty: no browser client of another site.
    allowed_origins: tuple[str, ...] = ()
    # Where a job's completion or failure is POSTed (OpenAI's video.completed / video.failed events), signed with
    # webhook_secret (serve/webhook_sender.py). Empty: no webhooks.
    webhook_urls: tuple[str, ...] = ()
    webhook_secret: str | None = None
    # The model id /v1/models lists and jobs report (the reference's --served-model-name); the names a request's
    # `model` may use otherwise (the hub id, the variant, the folder) stay accepted. None: the checkpoint's id.
    served_model_name: str | None = None
    # The path prefix a reverse proxy serves the API under ("/k6"), or "": job URLs and /docs carry it, and requests
    # are served with it (a proxy that passes the path on) or without it (one that strips it).
    root_path: str = ""
    cleanup_interval_s: float = 60.0
    cancel_wait_s: float = 10.0  # how long DELETE waits for a running job to stop at a step boundary

    def __post_init__(self) -> None:
        if not (0 < self.port < 65536):
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if not math.isfinite(self.output_ttl_s):
            # math.ceil in `jobs.expires_at` raised on nan and inf: every finished job read as a 500.
            raise ValueError(f"--output-ttl must be a finite number of seconds (0 keeps outputs forever), got "
                             f"{self.output_ttl_s}")
        if self.output_ttl_s < 0:
            raise ValueError(f"--output-ttl must be >= 0 seconds (0 keeps outputs forever), got {self.output_ttl_s}")
        if self.max_queued_jobs < 1:
            raise ValueError(f"--max-queued-jobs must be >= 1, got {self.max_queued_jobs}")
        if not math.isfinite(self.max_upload_mb) or self.max_upload_mb <= 0:
            raise ValueError(f"--max-upload-mb must be a finite number > 0, got {self.max_upload_mb}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty; leave it unset to disable authentication.")
        if self.api_key is not None and self.api_key != self.api_key.strip():
            # HTTP drops the spaces around a header value, so no client could ever send this key.
            raise ValueError("--api-key must not start or end with whitespace, which no Authorization header can "
                             "carry; pass the key without it.")
        if self.api_key is not None and not all(" " <= character <= "~" for character in self.api_key):
            # A header value is visible ASCII and spaces (RFC 9110 5.5): a key with a newline (a file read with its
            # line end) or any other character was accepted, and every request was then a 401.
            raise ValueError("--api-key must be printable ASCII (letters, digits, punctuation, inner spaces), which "
                             "is what an Authorization header carries; it holds another character (a line end from a "
                             "file read whole?).")

        if "*" in self.allowed_origins and self.api_key is None:
            # Without a key, any page a visitor of this machine opens could make jobs and read every answer (a
            # listed origin is one site the operator chose; "*" is every site on the web).
            raise ValueError("--allowed-origin '*' lets every web page a visitor opens use this server through the "
                             "visitor's browser; with no --api-key that is anyone's page making jobs. Add --api-key "
                             "(the page's script sends the key), or list the pages' origins instead of '*' "
                             "(--allowed-origin https://app.example.com).")
        if self.webhook_urls and not self.webhook_secret:
            # Unsigned, a receiver cannot tell this server's events from anyone's POST to its URL.
            raise ValueError("--webhook-url needs --webhook-secret (or $K6SERVE_WEBHOOK_SECRET) to sign the events, "
                             "so the receiver can check they come from this server; generate one with python -c "
                             "\"import base64, secrets; print('whsec_' + base64.b64encode(secrets.token_bytes(32))"
                             ".decode())\" and give the receiver the same.")
        if self.webhook_urls and self.webhook_secret is not None:  # a stray $K6SERVE_WEBHOOK_SECRET alone is unused
            from k6serve.serve.webhook_transport import secret_key

            secret_key(self.webhook_secret)  # refused now if unusable, not at the first event
        if self.root_path:
            check_root_path(self.root_path)
        if self.served_model_name is not None:
            name = self.served_model_name
            if not name.strip() or name != name.strip() or not name.isprintable():
                # Compared with a request's `model` as given (lower-cased): a name with spaces around it or a
                # control character could never be matched, and an empty one lists a model with no id.
                raise ValueError(f"--served-model-name must be a non-empty name without spaces around it or "
                                 f"control characters, got {name!r}; e.g. --served-model-name k6-pro-distill.")

    def check_paths(self) -> None:
        """Refuse, before the model loads, an output folder or job store whose path a file or a folder already takes
        (they failed as a bare "File exists" or an internal sqlite error)."""
        for flag, path, want_dir in (("--output-path", self.output_path, True),
                                     ("--job-store", self.job_store_path, False)):
            if path.exists():
                if path.is_dir() != want_dir:
                    what = "a file, not a folder" if want_dir else "a folder, not a file"
                    raise ValueError(f"{flag} {str(path)!r} is {what}; pass " + (
                        "a folder (it is created if missing)." if want_dir else "the path of a SQLite file (it is "
                        "created if missing), e.g. jobs.sqlite3 inside that folder."))
                continue
            for parent in path.parents:
                if parent.exists():
                    if not parent.is_dir():
                        raise ValueError(f"{flag} {str(path)!r} lies under {str(parent)!r}, which is a file, not a "
                                         "folder; pass a path in a folder.")
                    break

    @property
    def job_store_path(self) -> Path:
        return self.job_store if self.job_store is not None else self.output_path / "jobs.sqlite3"

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)


# The first path segments of the server's own routes: a --root-path starting with one would be stripped from them.
_ROUTE_SEGMENTS = frozenset({"v1", "health", "metrics", "release_memory_occupation", "resume_memory_occupation",
                             "docs", "redoc", "openapi.json"})  # tests/server/test_lifecycle.py checks it is whole


def normal_root_path(value: str) -> str:
    """--root-path as the server keeps it: "/k6/" and "k6" are "/k6", "/" is "" (no prefix)."""
    value = value.strip()
    return "" if value.strip("/") == "" else "/" + value.strip("/")


def check_root_path(root_path: str) -> None:
    """Refuse a --root-path that is no plain URL path prefix, or that would hide the server's own routes."""
    segments = root_path.split("/")[1:]
    if not root_path.startswith("/") or root_path.endswith("/") or not all(
            segment and all(character.isascii() and character.isprintable() and character not in " ?#%\\"
                            for character in segment) for segment in segments):
        raise ValueError(f"--root-path must be a URL path prefix such as /k6 (ASCII, no spaces, '?', '#' or '%'), "
                         f"got {root_path!r}")
    if segments[0] in _ROUTE_SEGMENTS:
        raise ValueError(f"--root-path {root_path!r} starts with /{segments[0]}, one of the server's own routes; "
                         "choose another prefix, e.g. /k6")


# Ports that browsers leave out of an Origin (https://example.com, never https://example.com:443).
_DEFAULT_PORTS = {"http": 80, "https": 443}


def normal_origin(value: str) -> str:
    """An --allowed-origin as browsers write the Origin header: "scheme://host[:port]", lower-case, without the
    scheme's default port; "*" as is. CORS compares origins as strings, so "https://App.example.com/" or
    "https://app.example.com:443" would never have matched a browser's "https://app.example.com"."""
    text = value.strip()
    if text == "*":
        return text
    fix = ("an origin is the page's scheme, host and port only, as its browser sends it in the Origin header: "
           "e.g. --allowed-origin https://app.example.com or --allowed-origin http://localhost:5173")
    if not text:
        raise ValueError(f"--allowed-origin is empty; {fix}.")
    if text.lower() == "null":
        raise ValueError("--allowed-origin null is refused: browsers send Origin: null from a page opened as a file "
                         "and from any sandboxed frame of any site, so it would let every such page in; serve the page "
                         "over http (python -m http.server) and list that origin, e.g. http://localhost:8000.")
    if "*" in text:
        raise ValueError(f"--allowed-origin {value!r}: a wildcard inside an origin is not supported; list each "
                         f"origin (repeat the flag), or pass '*' alone for every page (with --api-key); {fix}.")
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError as exc:  # a port out of range or not a number, "http://[::1"
        raise ValueError(f"--allowed-origin {value!r} is not an origin ({exc}); {fix}.") from None
    if not parts.scheme or not parts.hostname or "//" not in text:
        raise ValueError(f"--allowed-origin {value!r} has no scheme and host; {fix}.")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username is not None \
            or parts.password is not None or text.endswith(("?", "#")):
        raise ValueError(f"--allowed-origin {value!r} has more than an origin (a path, query or user name); {fix}.")
    host = parts.hostname.lower()
    if not host.isascii():
        # Browsers send an international name in its ASCII (punycode) form: https://xn--e1afmkfd.xn--p1ai.
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise ValueError(f"--allowed-origin {value!r}: {host!r} is not a valid host name; {fix}.") from None
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address, bracketed as in a URL
    scheme = parts.scheme.lower()
    keep_port = port is not None and _DEFAULT_PORTS.get(scheme) != port
    return f"{scheme}://{host}{f':{port}' if keep_port else ''}"


def settings_from_options(options: dict[str, Any]) -> ServerSettings:
    """CLI option names (flag names with '_') to ServerSettings; the API key falls back to $K6SERVE_API_KEY."""
    known = {"host", "port", "output_path", "job_store", "output_ttl", "max_queued_jobs", "max_upload_mb",
             "allowed_input_dir", "allowed_lora_dir", "allowed_origin", "api_key", "served_model_name", "root_path",
             "webhook_url", "webhook_secret"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"Unknown server option(s) {unknown}; valid: {sorted(known)}")
    values: dict[str, Any] = {}
    for name in ("host", "port", "max_queued_jobs", "max_upload_mb", "served_model_name"):
        if options.get(name) is not None:
            values[name] = options[name]
    for name in ("output_path", "job_store"):
        # Path("") is ".": an empty --output-path served from the working folder, an empty --job-store failed as
        # "PosixPath('.') has an empty name".
        if options.get(name) is not None and not str(options[name]).strip():
            raise ValueError(f"{flag_name(name)} is empty; pass a path, or leave it out for the default.")
    if options.get("output_path") is not None:
        values["output_path"] = Path(options["output_path"])
    if options.get("root_path") is not None:
        values["root_path"] = normal_root_path(str(options["root_path"]))
    if options.get("job_store") is not None:
        values["job_store"] = Path(options["job_store"])
    if options.get("output_ttl") is not None:
        values["output_ttl_s"] = float(options["output_ttl"])
    for option in ("allowed_input_dir", "allowed_lora_dir"):
        if options.get(option):
            dirs = options[option]
            values[f"{option}s"] = tuple(_allowed_dir(d, option) for d in ([dirs] if isinstance(dirs, str) else dirs))
    if options.get("allowed_origin"):
        origins = options["allowed_origin"]
        normal = (normal_origin(origin) for origin in ([origins] if isinstance(origins, str) else origins))
        values["allowed_origins"] = tuple(dict.fromkeys(normal))  # in order, once each
    if options.get("webhook_url"):
        urls = options["webhook_url"]
        # Canonical, so one receiver spelled two ways is one URL, as the job store's kept events name it.
        values["webhook_urls"] = tuple(dict.fromkeys(check_webhook_url(url) for url in
                                                     ([urls] if isinstance(urls, str) else urls)))
    webhook_secret = options.get("webhook_secret")
    webhook_secret = (os.environ.get(WEBHOOK_SECRET_ENV) or None) if webhook_secret is None else webhook_secret
    if webhook_secret is not None:
        values["webhook_secret"] = webhook_secret
    # An explicit empty --api-key is refused by ServerSettings (it ran with no key at all); an empty
    # $K6SERVE_API_KEY is as if unset.
    api_key = options.get("api_key")
    from_environment = api_key is None and bool(os.environ.get(API_KEY_ENV))
    api_key = (os.environ.get(API_KEY_ENV) or None) if api_key is None else api_key
    if api_key is not None:
        values["api_key"] = api_key
    try:
        return ServerSettings(**values)
    except ValueError as exc:
        if from_environment and "--api-key" in str(exc):
            # The key came from the environment: the message named a flag the user never typed.
            raise ValueError(str(exc).replace("--api-key", f"${API_KEY_ENV} (the --api-key default)", 1)) from None
        raise


def _allowed_dir(value: str, option: str) -> Path:
    """An --allowed-input-dir / --allowed-lora-dir: "" is Path("."), which let requests read any file under the
    working folder; a file allowed nothing."""
    flag, example = flag_name(option), "./inputs" if option == "allowed_input_dir" else "./loras"
    if not str(value).strip():
        raise ValueError(f"{flag} is empty; pass a folder (e.g. {flag} {example}).")
    folder = Path(value).expanduser()  # a --config file's "~/loras" is not expanded by a shell
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {str(folder)!r} is a file, not a folder; pass the folder that holds the "
                         f"{'input files' if option == 'allowed_input_dir' else 'adapters'}.")
    return folder
