"""Peers: the vaults this one may import from (the remote tier's configuration).

- peer: a name (it appears in provenance as "peer:<name>"), the base URL of its
  `kvpack serve`, and the peer API key it issued to us (role peer).
- peers file: `<data dir>/peers.json` (KVPACK_PEERS), mode 0600 since it holds
  bearer keys: {"peers": [{"name", "url", "api_key"}, ...]}. `kvpack peers` edits it.
Which producers' signatures are accepted is a separate question, answered by the
trust store (`kvpack keys trust`): a peer is a transport, never an authority.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cas.keys import write_secret

FORMAT = "kvpack-peers-v1"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class Peer:
    name: str
    url: str
    api_key: str

    def __post_init__(self) -> None:
        if not NAME.match(self.name):
            raise ValueError(f"peer name {self.name!r}: use 1-63 letters, digits, '.', '_', '-'")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"peer {self.name}: url {self.url!r} is not an http(s) URL")
        if not self.api_key:
            raise ValueError(f"peer {self.name}: api_key is empty")


def load_peers(path: Path) -> list[Peer]:
    """The configured peers; none when the file does not exist."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except ValueError as e:
        raise ValueError(f"peers file {path}: not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"peers file {path}: format is not {FORMAT!r}")
    try:
        peers = [Peer(p["name"], p["url"].rstrip("/"), p["api_key"]) for p in doc["peers"]]
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"peers file {path}: malformed entry: {e}") from None
    names = [p.name for p in peers]
    if len(set(names)) != len(names):
        raise ValueError(f"peers file {path}: duplicate peer names in {names}")
    return peers


def save_peers(path: Path, peers: list[Peer]) -> None:
    """Write with mode 0600, atomically."""
    write_secret(
        path, json.dumps({"format": FORMAT, "peers": [asdict(p) for p in peers]}, indent=2)
    )
