"""Settings: defaults < TOML file < environment < overrides; engines with sane settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from kvpack.config import ConfigError, Settings, make_engine, normalize_database_url


def test_defaults_put_everything_under_the_data_dir(tmp_path):
    """Embedded default: SQLite file, local objects dir and keyring under the data dir."""
    s = Settings.load(env={"KVPACK_DATA_DIR": str(tmp_path)})
    assert s.data_dir == tmp_path
    assert s.database_url == f"sqlite:///{tmp_path}/catalog.sqlite3"
    assert s.store_url == (tmp_path / "objects").as_uri()
    assert s.keyring_path == tmp_path / "keyring.json"
    assert (s.alignment, s.namespace) == (256, "default")


def test_default_data_dir_is_per_user(monkeypatch, tmp_path):
    """Branch: nothing configured -> ~/.kvpack."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Settings.load(env={}).data_dir == tmp_path / ".kvpack"


def test_precedence_file_then_env_then_overrides(tmp_path):
    """Each source overrides the one before it, field by field."""
    cfg = tmp_path / "kvpack.toml"
    cfg.write_text('namespace = "from-file"\nalignment = 64\nstore_url = "s3://b/p"\n')
    env = {"KVPACK_CONFIG": str(cfg), "KVPACK_NAMESPACE": "from-env", "KVPACK_DATA_DIR": "/d"}
    s = Settings.load(env=env)
    assert (s.namespace, s.alignment, s.store_url) == ("from-env", 64, "s3://b/p")
    s = Settings.load(env=env, namespace="from-override", alignment=None)
    assert (s.namespace, s.alignment) == ("from-override", 64)  # None means "not given"


def test_postgres_urls_are_pinned_to_psycopg3():
    """postgresql:// and postgres:// use the installed psycopg driver."""
    for url in ("postgresql://u@h:5432/db", "postgres://u@h:5432/db"):
        assert normalize_database_url(url) == "postgresql+psycopg://u@h:5432/db"
    s = Settings.load(env={"KVPACK_DATABASE_URL": "postgresql://u:pw@h/db"})
    assert s.database_url == "postgresql+psycopg://u:pw@h/db"


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"KVPACK_ALIGNMENT": "abc"}, "alignment"),
        ({"KVPACK_ALIGNMENT": "0"}, "alignment"),
        ({"KVPACK_DATABASE_URL": "not a url"}, "database_url"),
    ],
)
def test_bad_values_name_the_setting_and_its_source(env, name):
    """Bad input -> ConfigError naming the setting and where it came from."""
    with pytest.raises(ConfigError) as e:
        Settings.load(env=env)
    assert e.value.name == name and e.value.source.startswith("$KVPACK_")


def test_unknown_keys_and_missing_files_are_refused(tmp_path):
    """A typo in the TOML file, an unknown override or a missing file is an error."""
    cfg = tmp_path / "kvpack.toml"
    cfg.write_text('namspace = "x"\n')
    with pytest.raises(ConfigError, match="namspace"):
        Settings.load(config_file=cfg, env={})
    with pytest.raises(ConfigError, match="colour"):
        Settings.load(env={}, colour="blue")
    with pytest.raises(ConfigError, match="not found"):
        Settings.load(config_file=tmp_path / "absent.toml", env={})


def test_keyring_is_created_once_with_private_mode(tmp_path):
    """Settings.keyring() creates the keyring file (0600) and then reuses it."""
    s = Settings.load(env={"KVPACK_DATA_DIR": str(tmp_path)})
    ring = s.keyring()
    assert Path(s.keyring_path).stat().st_mode & 0o777 == 0o600
    assert s.keyring() == ring


def test_sqlite_engine_settings(tmp_path):
    """SQLite engines: WAL, busy timeout, foreign keys on, write lock taken at BEGIN."""
    engine = make_engine(f"sqlite:///{tmp_path}/sub/dir/c.sqlite3")  # parent dirs created
    try:
        with engine.begin() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() >= 1000
            conn.execute(text("CREATE TABLE t (x INTEGER)"))
        # A second connection cannot write while the first holds a transaction open:
        # BEGIN IMMEDIATE took the write lock up front.
        other = make_engine(f"sqlite:///{tmp_path}/sub/dir/c.sqlite3")
        with other.connect() as c2:
            c2.exec_driver_sql("PRAGMA busy_timeout=50")
            c2.rollback()
            with engine.begin(), pytest.raises(OperationalError, match="locked"):
                c2.begin()
        other.dispose()
    finally:
        engine.dispose()
