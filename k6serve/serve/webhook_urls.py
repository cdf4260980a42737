"""A `--webhook-url` checked and put in canonical form (`check_webhook_url`, at start), and a URL or an error about
one as logs show them (`shown_url`, `shown_location`, `failure_reason`).

URLs are compared in the canonical form `check_webhook_url` gives them (scheme and host lower-cased, the scheme's
default port dropped; path and query as given), and one with whitespace or a control character is refused. Logs show
a URL as `shown_url` does (scheme://host[:port]/...: a hook URL's path or query often holds its token), a redirect's
Location too, and never an error text that could quote the URL's path or query.
"""

from __future__ import annotations

import http.client
import urllib.parse

DEFAULT_PORTS = {"http": 80, "https": 443}


def check_webhook_url(url: str) -> str:
    """`url`'s canonical form: stripped, scheme and host lower-cased, the scheme's default port dropped, path and
    query as given (so a receiver spelled two ways is one URL); a ValueError with the fix if it is no usable http(s)
    URL with a host (checked at start)."""
    text = url.strip()
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port  # raises on a port that is no number or out of range
    except ValueError as exc:
        raise ValueError(f"--webhook-url {url!r} is not a URL ({exc}); pass e.g. "
                         "--webhook-url https://hooks.example.com/k6serve") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--webhook-url {url!r} must be an http:// or https:// URL with a host, e.g. "
                         "--webhook-url https://hooks.example.com/k6serve")
    if parts.username is not None or parts.password is not None:
        # urllib resolved "user:pw@host" as a host name: every delivery failed, and the warning logged the password.
        raise ValueError(f"--webhook-url {shown_url(text)}: a user name or password in the URL is not sent; put a "
                         "token in the URL's path or query instead (the events are signed with --webhook-secret).")
    position = next((index for index, character in enumerate(text)
                     if character.isspace() or not character.isprintable()), None)
    if position is not None:
        # http.client refused each attempt with an InvalidURL quoting the whole URL, token and all (urlsplit alone
        # drops tabs and line ends silently). Not echoed here either: the token may sit next to the character.
        raise ValueError(f"--webhook-url {shown_url(text)} holds a space or control character (at character "
                         f"{position + 1}), which no HTTP request line can carry: percent-encode it (%20 for a "
                         "space) or remove it (a line end from a file read whole?).")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port_part = "" if port is None or port == DEFAULT_PORTS[parts.scheme] else f":{port}"
    # Sliced from the text, not rebuilt by urlunsplit, which drops an empty query's "?" and so changes the URL.
    rest = text[len(parts.scheme) + len("://") + len(parts.netloc):]
    if not rest.isascii():
        # http.client sends the request line as ASCII: every attempt raised UnicodeEncodeError, retried for 72 hours
        # and never delivered. (A non-ASCII host is fine: it is sent IDNA-encoded.)
        raise ValueError(f"--webhook-url {shown_url(text)} holds a non-ASCII character in its path or query, which "
                         "no HTTP request line can carry: percent-encode it as UTF-8 (é is %C3%A9).")
    return f"{parts.scheme}://{host}{port_part}{rest}"


def shown_url(url: str) -> str:
    """`url` as logs show it: scheme://host[:port] only, as a hook URL's path or query often holds its token."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}/..."


def shown_location(url: str, location: str) -> str:
    """A redirect's Location (relative to `url`) as logs show it: reduced as by `shown_url`, as it may hold a token
    too."""
    if not location:
        return "no Location"
    try:
        target = urllib.parse.urljoin(url, location)
        if not urllib.parse.urlsplit(target).hostname:
            return "a Location with no host"
        return repr(shown_url(target)[:200])
    except ValueError:  # a port that is no number, an unclosed "[" in the host
        return "an unreadable Location"


def failure_reason(exc: BaseException, url: str) -> str:
    """`exc` as a log about `url` shows it: its type and text, or its type and a generic reason where the text (or
    the one of an exception it came from) could quote the URL's path or query, as http.client's InvalidURL does."""
    if may_quote_url(exc, url):
        return f"{type(exc).__name__}: the URL or request was refused (details not shown: they quote the URL)"
    return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def may_quote_url(exc: BaseException, url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    pieces = [piece for piece in (parts.path, parts.query) if len(piece) > 1]  # a bare "/" holds no token
    seen: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in seen:
        text = str(cause)
        if isinstance(cause, http.client.InvalidURL) or any(piece in text for piece in pieces):
            return True
        seen.append(cause)
        cause = cause.__cause__ or cause.__context__
    return False
