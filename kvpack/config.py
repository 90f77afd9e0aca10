"""Settings: where the vault lives and how to reach it.

Sources, strongest first: keyword overrides to Settings.load() (the CLI's flags), the
environment, an optional TOML file (KVPACK_CONFIG; keys are the field names; see
infra/kvpack.example.toml), then the defaults. Every setting is one row of SETTINGS:
its field, the environment variables read for it (first set wins; the standard AWS_*
names come after kvpack's own), its parser and its default.

    data_dir          KVPACK_DATA_DIR       ~/.kvpack (per user, outside any checkout)
    database_url      KVPACK_DATABASE_URL   sqlite:///<data dir>/catalog.sqlite3
    store_url         KVPACK_STORE_URL      file://<data dir>/objects, or s3://bucket/prefix
    namespace         KVPACK_NAMESPACE      the default tenant namespace (identity salt)
    alignment         KVPACK_ALIGNMENT      token alignment A (256)
    keyring_path      KVPACK_KEYRING        <data dir>/keyring.json (created 0600)
    producer_key_path KVPACK_PRODUCER_KEY   <data dir>/producer-key.json (created 0600)
    peers_path        KVPACK_PEERS          <data dir>/peers.json (kvpack/remote/peers.py)
    peer_timeout_s    KVPACK_PEER_TIMEOUT   seconds one remote import may wait on a peer (10)
    catalog_timeout_s KVPACK_CATALOG_TIMEOUT  seconds one catalog call may wait (10;
                                            catalog/db.py)
    outage_backoff_s  KVPACK_OUTAGE_BACKOFF seconds a dependency that stopped answering
                                            is skipped before a probe (5, doubling to 60)
    s3_endpoint       KVPACK_S3_ENDPOINT, AWS_ENDPOINT_URL          (AWS when unset)
    s3_region         KVPACK_S3_REGION, AWS_REGION, AWS_DEFAULT_REGION   (us-east-1)
    s3_access_key     KVPACK_S3_ACCESS_KEY, AWS_ACCESS_KEY_ID
    s3_secret_key     KVPACK_S3_SECRET_KEY, AWS_SECRET_ACCESS_KEY
    s3_secret_key_file KVPACK_S3_SECRET_KEY_FILE  a file holding the secret key (one line)
    s3_direct_get     KVPACK_S3_DIRECT_GET  chunk reads straight from the socket into their
                                            buffers (true; false: through the S3 client,
                                            as when a proxy is set; cas/s3_get.py)
    drain_timeout_s   KVPACK_DRAIN_TIMEOUT  seconds `kvpack serve` drains on SIGTERM (30)
    store_budget      KVPACK_STORE_BUDGET   the vault's byte budget ("50GiB"; unset: none)
    gc_interval_s     KVPACK_GC_INTERVAL    the maintainer's GC interval ("5m"; 0: off)
    gc_grace_s        KVPACK_GC_GRACE       how long an unreferenced chunk is kept ("1h")
    quarantine_retention_s  KVPACK_QUARANTINE_RETENTION  quarantined imports kept ("7d")
    verify_interval_s KVPACK_VERIFY_INTERVAL  the maintainer's verify interval (0: off)
    mlx_cache_limit   KVPACK_MLX_CACHE_LIMIT  freed memory MLX keeps for reuse ("2GiB";
                                            unset: MLX's own default). Restores reuse it
                                            instead of faulting in fresh zeroed pages.
    restore_reserve   KVPACK_RESTORE_RESERVE  memory mapped at start for the first restore
                                            (unset: one slot at the model's full context
                                            and the reader's scratch, at most 2GiB; "0":
                                            none; engine/memory.py)
    preload           KVPACK_PRELOAD        bytes of the most recently used cuts' chunks read
                                            into the page cache at start, for 10 s at
                                            most ("1GiB"; "0": none; a local directory
                                            only: kvpack/service/warm.py)
    publish           KVPACK_PUBLISH        whether cold prefills publish their cuts (true;
                                            false: an A/B control, a read-only replica)
    publish_max_defer_s KVPACK_PUBLISH_MAX_DEFER  the longest a durable cut waits for its
                                            request to be served ("30s")

The data dir is created 0700 (and tightened to 0700 if it was looser). S3 secrets are
best given by the environment or a file: a secret on a command line is visible to every
user of the machine (`ps`).

The store URL is parsed once, here (cas.open.StoreUrl). The embedded default is SQLite
plus a local directory under the data dir; pointing many instances at one PostgreSQL and
one bucket is the same code.
"""

from __future__ import annotations

import os
import secrets
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from cas.breaker import DEFAULT_BACKOFF_S
from cas.keys import Keyring
from cas.open import StoreUrl, open_object_store, parse_store_url
from cas.s3 import S3Config
from cas.store import ObjectStore
from catalog.db import DEFAULT_TIMEOUT_S, make_engine, normalize_database_url
from catalog.signing import ProducerKeys
from kvpack.units import parse_duration, parse_size

DEFAULT_DATA_DIR = Path("~/.kvpack")
DEFAULT_ALIGNMENT = 256
DEFAULT_PEER_TIMEOUT_S = 10.0
DEFAULT_S3_REGION = "us-east-1"
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_GC_INTERVAL_S = 300.0
DEFAULT_GC_GRACE_S = 3600.0
DEFAULT_QUARANTINE_RETENTION_S = 7 * 86400.0
DEFAULT_PRELOAD = 1 << 30
DEFAULT_PUBLISH_MAX_DEFER_S = 30.0  # kvpack/service/publication.py DEFAULT_MAX_DEFER_S
PRODUCER_FILE = "producer-id"


class ConfigError(ValueError):
    """A setting is missing, unknown or malformed; the message names it and its source."""

    def __init__(self, name: str, source: str, problem: str) -> None:
        super().__init__(f"setting {name!r} from {source}: {problem}")
        self.name, self.source, self.problem = name, source, problem


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    database_url: str
    store_url: StoreUrl
    keyring_path: Path
    producer_key_path: Path
    peers_path: Path
    alignment: int = DEFAULT_ALIGNMENT
    namespace: str = "default"
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S
    catalog_timeout_s: float = DEFAULT_TIMEOUT_S
    outage_backoff_s: float = DEFAULT_BACKOFF_S
    s3_endpoint: str | None = None
    s3_region: str = DEFAULT_S3_REGION
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    store_budget: int | None = None
    gc_interval_s: float = DEFAULT_GC_INTERVAL_S
    gc_grace_s: float = DEFAULT_GC_GRACE_S
    quarantine_retention_s: float = DEFAULT_QUARANTINE_RETENTION_S
    verify_interval_s: float = 0.0
    s3_secret_key_file: Path | None = None
    mlx_cache_limit: int | None = None
    restore_reserve: int | None = None
    preload: int = DEFAULT_PRELOAD
    publish: bool = True
    publish_max_defer_s: float = DEFAULT_PUBLISH_MAX_DEFER_S
    s3_direct_get: bool = True

    def __repr__(self) -> str:  # never print a secret
        secret = "***" if self.s3_secret_key else None
        return (
            f"Settings(data_dir={str(self.data_dir)!r}, store_url={str(self.store_url)!r}, "
            f"namespace={self.namespace!r}, alignment={self.alignment}, "
            f"s3_endpoint={self.s3_endpoint!r}, s3_secret_key={secret})"
        )

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
        for setting in SETTINGS:
            for var in setting.env:
                if env.get(var):
                    raw[setting.name] = (env[var], f"${var}")
                    break
        for name, value in overrides.items():
            if value is not None:
                raw[name] = (value, "overrides")
        _one_secret(raw)
        values: dict[str, Any] = {}
        for setting in SETTINGS:  # data_dir first: other defaults live under it
            value, source = raw.get(setting.name, (None, "defaults"))
            if value is None:
                values[setting.name] = setting.default(values)
                continue
            try:
                values[setting.name] = setting.parse(value)
            except (TypeError, ValueError) as e:
                raise ConfigError(setting.name, source, str(e)) from None
        if values["s3_secret_key_file"] is not None:
            values["s3_secret_key"] = _read_secret(values["s3_secret_key_file"])
        if (values["s3_access_key"] is None) != (values["s3_secret_key"] is None):
            raise ConfigError("s3_secret_key", "settings", "give both S3 keys or neither")
        return cls(**values)

    @staticmethod
    def environment_variables() -> dict[str, tuple[str, ...]]:
        """Setting name -> the environment variables read for it (first set wins)."""
        return {s.name: s.env for s in SETTINGS} | {"config_file": ("KVPACK_CONFIG",)}

    # -- what the settings open ------------------------------------------------------------

    def ensure_data_dir(self) -> Path:
        """The data dir, created 0700; an existing one of ours that others could read is
        made 0700 (it holds the keyring, the producer key and the catalog)."""
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = self.data_dir.stat()
        if info.st_uid == os.getuid() and info.st_mode & 0o077:
            self.data_dir.chmod(0o700)
        return self.data_dir

    def keyring(self) -> Keyring:
        """The vault keyring, created (mode 0600) on first use."""
        return Keyring.load_or_create(self.keyring_path)

    def producer_keys(self) -> ProducerKeys:
        """This vault's producer keys, created (mode 0600) on first use, named after the
        vault's producer id."""
        self.ensure_data_dir()
        return ProducerKeys.load_or_create(self.producer_key_path, producer_id(self.data_dir))

    def make_engine(self, **kwargs: Any) -> Engine:
        kwargs.setdefault("timeout_s", self.catalog_timeout_s)
        return make_engine(self.database_url, **kwargs)

    def s3_config(self) -> S3Config | None:
        """The S3 client settings for an s3:// store; None for a local one."""
        store = self.store_url
        if not store.is_s3:
            return None
        assert store.bucket is not None
        return S3Config(
            bucket=store.bucket,
            prefix=store.prefix,
            endpoint_url=self.s3_endpoint,
            region=self.s3_region,
            access_key=self.s3_access_key,
            secret_key=self.s3_secret_key,
            breaker_backoff_s=self.outage_backoff_s,
            direct_get=self.s3_direct_get,
        )

    def open_store(self) -> ObjectStore:
        return open_object_store(self.store_url, s3=self.s3_config())


@dataclass(frozen=True)
class Setting:
    name: str
    env: tuple[str, ...]
    parse: Callable[[Any], Any]
    default: Callable[[dict[str, Any]], Any]


def _path(value: Any) -> Path:
    return Path(str(value)).expanduser().absolute()


def _alignment(value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"not an integer: {value!r}") from None
    if isinstance(value, bool) or n < 1:
        raise ValueError(f"must be a positive integer, got {value!r}")
    return n


def _positive_seconds(value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"not a number: {value!r}") from None
    if isinstance(value, bool) or not 0 < seconds < float("inf"):
        raise ValueError(f"must be a positive number of seconds, got {value!r}")
    return seconds


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty string, got {value!r}")
    return value


def _store_url(value: Any) -> StoreUrl:
    return parse_store_url(_text(value))


def _size(value: Any) -> int:
    return parse_size(value if isinstance(value, int) else str(value))


def _duration(value: Any) -> float:
    return parse_duration(value if isinstance(value, int | float) else str(value))


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}  # fmt: skip


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    got = _BOOLS.get(str(value).strip().lower())
    if got is None:
        raise ValueError(f"must be true or false (1/0, yes/no, on/off), got {value!r}")
    return got


SETTINGS: tuple[Setting, ...] = (
    Setting("data_dir", ("KVPACK_DATA_DIR",), _path, lambda v: _path(DEFAULT_DATA_DIR)),
    Setting(
        "database_url",
        ("KVPACK_DATABASE_URL",),
        lambda value: normalize_database_url(_text(value)),
        lambda v: normalize_database_url(f"sqlite:///{v['data_dir'] / 'catalog.sqlite3'}"),
    ),
    Setting(
        "store_url",
        ("KVPACK_STORE_URL",),
        _store_url,
        lambda v: parse_store_url((v["data_dir"] / "objects").as_uri()),
    ),
    Setting("namespace", ("KVPACK_NAMESPACE",), _text, lambda v: "default"),
    Setting("alignment", ("KVPACK_ALIGNMENT",), _alignment, lambda v: DEFAULT_ALIGNMENT),
    Setting("keyring_path", ("KVPACK_KEYRING",), _path, lambda v: v["data_dir"] / "keyring.json"),
    Setting(
        "producer_key_path",
        ("KVPACK_PRODUCER_KEY",),
        _path,
        lambda v: v["data_dir"] / "producer-key.json",
    ),
    Setting("peers_path", ("KVPACK_PEERS",), _path, lambda v: v["data_dir"] / "peers.json"),
    Setting(
        "peer_timeout_s",
        ("KVPACK_PEER_TIMEOUT",),
        _positive_seconds,
        lambda v: DEFAULT_PEER_TIMEOUT_S,
    ),
    Setting(
        "catalog_timeout_s",
        ("KVPACK_CATALOG_TIMEOUT",),
        _positive_seconds,
        lambda v: DEFAULT_TIMEOUT_S,
    ),
    Setting(
        "outage_backoff_s",
        ("KVPACK_OUTAGE_BACKOFF",),
        _positive_seconds,
        lambda v: DEFAULT_BACKOFF_S,
    ),
    Setting("s3_endpoint", ("KVPACK_S3_ENDPOINT", "AWS_ENDPOINT_URL"), _text, lambda v: None),
    Setting(
        "s3_region",
        ("KVPACK_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION"),
        _text,
        lambda v: DEFAULT_S3_REGION,
    ),
    Setting("s3_access_key", ("KVPACK_S3_ACCESS_KEY", "AWS_ACCESS_KEY_ID"), _text, lambda v: None),
    Setting(
        "s3_secret_key", ("KVPACK_S3_SECRET_KEY", "AWS_SECRET_ACCESS_KEY"), _text, lambda v: None
    ),
    Setting(
        "drain_timeout_s",
        ("KVPACK_DRAIN_TIMEOUT",),
        _positive_seconds,
        lambda v: DEFAULT_DRAIN_TIMEOUT_S,
    ),
    Setting("store_budget", ("KVPACK_STORE_BUDGET",), _size, lambda v: None),
    Setting("gc_interval_s", ("KVPACK_GC_INTERVAL",), _duration, lambda v: DEFAULT_GC_INTERVAL_S),
    Setting("gc_grace_s", ("KVPACK_GC_GRACE",), _duration, lambda v: DEFAULT_GC_GRACE_S),
    Setting(
        "quarantine_retention_s",
        ("KVPACK_QUARANTINE_RETENTION",),
        _duration,
        lambda v: DEFAULT_QUARANTINE_RETENTION_S,
    ),
    Setting("verify_interval_s", ("KVPACK_VERIFY_INTERVAL",), _duration, lambda v: 0.0),
    Setting("s3_secret_key_file", ("KVPACK_S3_SECRET_KEY_FILE",), _path, lambda v: None),
    Setting("mlx_cache_limit", ("KVPACK_MLX_CACHE_LIMIT",), _size, lambda v: None),
    Setting("restore_reserve", ("KVPACK_RESTORE_RESERVE",), _size, lambda v: None),
    Setting("preload", ("KVPACK_PRELOAD",), _size, lambda v: DEFAULT_PRELOAD),
    Setting("publish", ("KVPACK_PUBLISH",), _bool, lambda v: True),
    Setting(
        "publish_max_defer_s",
        ("KVPACK_PUBLISH_MAX_DEFER",),
        _duration,
        lambda v: DEFAULT_PUBLISH_MAX_DEFER_S,
    ),
    Setting("s3_direct_get", ("KVPACK_S3_DIRECT_GET",), _bool, lambda v: True),
)


def _one_secret(raw: dict[str, tuple[Any, str]]) -> None:
    """The S3 secret and the file holding it are one setting given two ways: the stronger
    source wins (a --s3-secret-key-file flag over $AWS_SECRET_ACCESS_KEY); both from one
    source is a mistake."""
    key, path = raw.get("s3_secret_key"), raw.get("s3_secret_key_file")
    if key is None or path is None or key[0] is None or path[0] is None:
        return
    rank_key, rank_path = _rank(key[1]), _rank(path[1])
    if rank_key == rank_path:
        problem = "give the S3 secret key or a file holding it, not both"
        raise ConfigError("s3_secret_key_file", path[1], problem)
    del raw["s3_secret_key" if rank_key < rank_path else "s3_secret_key_file"]


def _rank(source: str) -> int:
    return 2 if source == "overrides" else 1 if source.startswith("$") else 0


def _read_secret(path: Path) -> str:
    try:
        secret = path.read_text().strip()
    except OSError as e:
        raise ConfigError("s3_secret_key_file", str(path), f"cannot read it: {e}") from None
    if not secret:
        raise ConfigError("s3_secret_key_file", str(path), "the file is empty")
    return secret


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
