"""Settings: where the vault lives and how to reach it.

Sources, strongest first: keyword overrides to Settings.load(), environment
variables, an optional TOML file, defaults.

    KVPACK_CONFIG        path of a TOML file (keys: the field names below)
    KVPACK_DATA_DIR      data dir (default ~/.kvpack: per user, outside any checkout)
    KVPACK_DATABASE_URL  SQLAlchemy URL (default sqlite:///<data dir>/catalog.sqlite3)
    KVPACK_STORE_URL     object store (default file://<data dir>/objects; or s3://bucket/prefix)
    KVPACK_NAMESPACE     tenant namespace salt for chunk ids (default "default")
    KVPACK_ALIGNMENT     token alignment A (default 256)
    KVPACK_KEYRING       vault keyring file (default <data dir>/keyring.json, created 0600)
    KVPACK_PRODUCER_KEY  producer signing keys (default <data dir>/producer-key.json, 0600)
    KVPACK_PEERS         peers file (default <data dir>/peers.json; see kvpack/peers.py)
    KVPACK_PEER_TIMEOUT  seconds one remote import may wait on a peer (default 10)

The embedded default is SQLite plus a local directory under the data dir;
pointing many instances at one PostgreSQL and one bucket is the same code.
"""

from __future__ import annotations

import os
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from cas.keys import Keyring
from catalog.signing import ProducerKeys

DEFAULT_DATA_DIR = Path("~/.kvpack")
DEFAULT_ALIGNMENT = 256
SQLITE_BUSY_TIMEOUT_MS = 30_000
PRODUCER_FILE = "producer-id"
_ENV = {
    "data_dir": "KVPACK_DATA_DIR",
    "database_url": "KVPACK_DATABASE_URL",
    "store_url": "KVPACK_STORE_URL",
    "namespace": "KVPACK_NAMESPACE",
    "alignment": "KVPACK_ALIGNMENT",
    "keyring_path": "KVPACK_KEYRING",
    "producer_key_path": "KVPACK_PRODUCER_KEY",
    "peers_path": "KVPACK_PEERS",
    "peer_timeout_s": "KVPACK_PEER_TIMEOUT",
}
DEFAULT_PEER_TIMEOUT_S = 10.0


class ConfigError(ValueError):
    """A setting is missing, unknown or malformed; the message names it and its source."""

    def __init__(self, name: str, source: str, problem: str) -> None:
        super().__init__(f"setting {name!r} from {source}: {problem}")
        self.name, self.source, self.problem = name, source, problem


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    database_url: str
    store_url: str
    keyring_path: Path
    producer_key_path: Path
    peers_path: Path
    alignment: int = DEFAULT_ALIGNMENT
    namespace: str = "default"
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S

    @classmethod
    def load(
        cls,
        *,
        config_file: Path | str | None = None,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> Settings:
        """Merge defaults < TOML file < environment < overrides, then validate."""
        env = os.environ if env is None else env
        known = {f.name for f in fields(cls)}
        for name in overrides:
            if name not in known:
                raise ConfigError(name, "overrides", f"unknown setting (known: {sorted(known)})")
        raw: dict[str, tuple[Any, str]] = {}
        path = config_file or env.get("KVPACK_CONFIG")
        if path:
            for name, value in _read_toml(Path(path).expanduser()).items():
                if name not in known:
                    raise ConfigError(name, str(path), f"unknown setting (known: {sorted(known)})")
                raw[name] = (value, str(path))
        for name, var in _ENV.items():
            if env.get(var):
                raw[name] = (env[var], f"${var}")
        for name, value in overrides.items():
            if value is not None:
                raw[name] = (value, "overrides")

        def get(name: str, default: Any) -> tuple[Any, str]:
            return raw.get(name, (default, "defaults"))

        data_dir = Path(get("data_dir", DEFAULT_DATA_DIR)[0]).expanduser().absolute()
        alignment, source = get("alignment", DEFAULT_ALIGNMENT)
        try:
            alignment = int(alignment)
        except (TypeError, ValueError):
            raise ConfigError("alignment", source, f"not an integer: {alignment!r}") from None
        if alignment < 1:
            raise ConfigError("alignment", source, f"must be positive, got {alignment}")
        namespace, source = get("namespace", "default")
        if not isinstance(namespace, str) or not namespace:
            raise ConfigError("namespace", source, "must be a non-empty string")
        database_url, source = get("database_url", f"sqlite:///{data_dir / 'catalog.sqlite3'}")
        try:
            database_url = normalize_database_url(str(database_url))
        except ValueError as e:
            raise ConfigError("database_url", source, str(e)) from None
        store_url = str(get("store_url", (data_dir / "objects").as_uri())[0])
        keyring_path = Path(get("keyring_path", data_dir / "keyring.json")[0]).expanduser()
        key_path = Path(get("producer_key_path", data_dir / "producer-key.json")[0]).expanduser()
        peers_path = Path(get("peers_path", data_dir / "peers.json")[0]).expanduser()
        timeout, source = get("peer_timeout_s", DEFAULT_PEER_TIMEOUT_S)
        try:
            timeout = float(timeout)
        except (TypeError, ValueError):
            raise ConfigError("peer_timeout_s", source, f"not a number: {timeout!r}") from None
        if not timeout > 0:
            raise ConfigError("peer_timeout_s", source, f"must be positive, got {timeout}")
        return cls(
            data_dir=data_dir,
            database_url=database_url,
            store_url=store_url,
            keyring_path=keyring_path.absolute(),
            producer_key_path=key_path.absolute(),
            peers_path=peers_path.absolute(),
            alignment=alignment,
            namespace=namespace,
            peer_timeout_s=timeout,
        )

    def keyring(self) -> Keyring:
        """The vault keyring, created (mode 0600) on first use."""
        return Keyring.load_or_create(self.keyring_path)

    def producer_keys(self) -> ProducerKeys:
        """This vault's producer keys, created (mode 0600) on first use, named after the
        vault's producer id."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return ProducerKeys.load_or_create(self.producer_key_path, producer_id(self.data_dir))

    def make_engine(self, **kwargs: Any) -> Engine:
        return make_engine(self.database_url, **kwargs)


def producer_id(data_dir: Path) -> str:
    """This vault instance's producer id, created once in the data dir (written to a temp
    file, then linked into place, so a concurrent opener never reads a half-written id)."""
    path = data_dir / PRODUCER_FILE
    if not path.exists():
        tmp = data_dir / f".{PRODUCER_FILE}.{secrets.token_hex(4)}"
        tmp.write_text(f"vault-{secrets.token_hex(8)}\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another opener won; use its id
        finally:
            tmp.unlink()
    return path.read_text().strip()


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("config_file", str(path), "file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config_file", str(path), f"not valid TOML: {e}") from None


def normalize_database_url(url: str) -> str:
    """Pin PostgreSQL URLs to psycopg 3 (the installed driver); refuse unparseable URLs."""
    try:
        parsed = make_url(url)
    except Exception as e:  # SQLAlchemy raises ArgumentError; callers want one type
        raise ValueError(f"not a database URL: {url!r}") from e
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An Engine with sane settings for the catalog.

    SQLite (the embedded, single-writer default): WAL, a busy timeout, foreign
    keys on, and every transaction opened with BEGIN IMMEDIATE, so a
    read-then-write transaction queues for the write lock up front instead of
    failing on a stale snapshot. PostgreSQL: pre-ping pooled connections.
    """
    parsed = make_url(normalize_database_url(url))
    if parsed.get_backend_name() != "sqlite":
        kwargs.setdefault("pool_pre_ping", True)
        return create_engine(parsed, **kwargs)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from pysqlite; SQLAlchemy's "begin" emits ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine
