"""Settings: defaults < TOML file < environment < overrides, one row per setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from catalog.db import normalize_database_url
from kvpack.config import ConfigError, Settings

EXAMPLE = Path(__file__).resolve().parents[2] / "infra" / "kvpack.example.toml"


def test_defaults_put_everything_under_the_data_dir(tmp_path):
    """Embedded default: SQLite file, local objects dir and keyring under the data dir."""
    s = Settings.load(env={"KVPACK_DATA_DIR": str(tmp_path)})
    assert s.data_dir == tmp_path
    assert s.database_url == f"sqlite:///{tmp_path}/catalog.sqlite3"
    assert str(s.store_url) == (tmp_path / "objects").as_uri()
    assert s.store_url.path == tmp_path / "objects" and s.s3_config() is None
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
    assert (s.namespace, s.alignment, str(s.store_url)) == ("from-env", 64, "s3://b/p")
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
        ({"KVPACK_STORE_URL": "gs://bucket/p"}, "store_url"),
        ({"KVPACK_STORE_URL": "s3:///no-bucket"}, "store_url"),
        ({"KVPACK_PEER_TIMEOUT": "inf"}, "peer_timeout_s"),
        ({"KVPACK_S3_ACCESS_KEY": "ak"}, "s3_secret_key"),
        ({"KVPACK_PUBLISH": "maybe"}, "publish"),
        ({"KVPACK_PUBLISH_MAX_DEFER": "-1"}, "publish_max_defer_s"),
        ({"KVPACK_S3_DIRECT_GET": "sometimes"}, "s3_direct_get"),
    ],
)
def test_bad_values_name_the_setting_and_its_source(env, name):
    """Bad input -> ConfigError naming the setting and where it came from."""
    with pytest.raises(ConfigError) as e:
        Settings.load(env=env)
    assert e.value.name == name
    assert e.value.source.startswith("$KVPACK_") or e.value.source == "settings"


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


def test_s3_settings_come_from_kvpack_names_then_aws_names(tmp_path):
    """The store URL is parsed once; the S3 client settings are settings like the rest:
    KVPACK_S3_* beats the standard AWS_* names, and a flag (override) beats both."""
    env = {
        "KVPACK_STORE_URL": "s3://vault/kv/prefix",
        "AWS_ENDPOINT_URL": "http://aws-name:9000",
        "KVPACK_S3_ENDPOINT": "http://kvpack-name:9000",
        "AWS_ACCESS_KEY_ID": "ak",
        "AWS_SECRET_ACCESS_KEY": "sk",
        "AWS_REGION": "eu-west-1",
    }
    s = Settings.load(env=env)
    c = s.s3_config()
    assert (c.bucket, c.key_prefix, c.endpoint_url) == (
        "vault",
        "kv/prefix/",
        "http://kvpack-name:9000",
    )
    assert (c.access_key, c.secret_key, c.region) == ("ak", "sk", "eu-west-1")
    assert "sk" not in repr(s)  # a secret never prints
    flagged = Settings.load(env=env, s3_endpoint="http://flag:1")
    assert flagged.s3_config().endpoint_url == "http://flag:1"


SAMPLES = {  # a raw value for each setting, and what it loads as
    "data_dir": ("/srv/vault", Path("/srv/vault")),
    "database_url": ("postgresql://u@h/db", "postgresql+psycopg://u@h/db"),
    "store_url": ("s3://b/p", "s3://b/p"),
    "namespace": ("acme", "acme"),
    "alignment": ("128", 128),
    "keyring_path": ("/k/ring.json", Path("/k/ring.json")),
    "producer_key_path": ("/k/producer.json", Path("/k/producer.json")),
    "peers_path": ("/k/peers.json", Path("/k/peers.json")),
    "peer_timeout_s": ("2.5", 2.5),
    "catalog_timeout_s": ("0.5", 0.5),
    "outage_backoff_s": ("30", 30.0),
    "s3_endpoint": ("http://minio:9000", "http://minio:9000"),
    "s3_region": ("eu-west-1", "eu-west-1"),
    "drain_timeout_s": ("12", 12.0),
    "store_budget": ("50GiB", 50 * 1024**3),
    "gc_interval_s": ("15m", 900.0),
    "gc_grace_s": ("1h30m", 5400.0),
    "quarantine_retention_s": ("7d", 7 * 86400.0),
    "verify_interval_s": ("30s", 30.0),
    "mlx_cache_limit": ("2GiB", 2 * 1024**3),
    "restore_reserve": ("512MiB", 512 * 1024**2),
    "preload": ("256MiB", 256 * 1024**2),
    "publish": ("off", False),
    "publish_max_defer_s": ("2m", 120.0),
    "s3_direct_get": ("false", False),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_setting_reads_each_of_its_environment_variables(name):
    """environment_variables() is the one list of what the settings read (deployment
    files are checked against it): every variable it names for a setting sets it."""
    raw, expected = SAMPLES[name]
    for variable in Settings.environment_variables()[name]:
        got = getattr(Settings.load(env={variable: raw}), name)
        assert (str(got) if name == "store_url" else got) == expected, variable


def test_the_s3_keys_are_read_from_both_names_and_only_in_pairs():
    both = Settings.environment_variables()
    assert both["s3_access_key"] == ("KVPACK_S3_ACCESS_KEY", "AWS_ACCESS_KEY_ID")
    assert both["s3_secret_key"] == ("KVPACK_S3_SECRET_KEY", "AWS_SECRET_ACCESS_KEY")
    s = Settings.load(env={"KVPACK_S3_ACCESS_KEY": "a", "AWS_SECRET_ACCESS_KEY": "s"})
    assert (s.s3_access_key, s.s3_secret_key) == ("a", "s")
    keys = {"s3_access_key", "s3_secret_key", "s3_secret_key_file"}
    assert set(SAMPLES) | keys == set(Settings.__dataclass_fields__)


def test_s3_direct_get_reaches_the_store_config():
    """s3_direct_get: on by default; false makes an s3:// store read through the client."""
    s3 = {"KVPACK_STORE_URL": "s3://bucket/vault", "KVPACK_S3_ENDPOINT": "http://127.0.0.1:1"}
    on = Settings.load(env=s3).s3_config()
    off = Settings.load(env={**s3, "KVPACK_S3_DIRECT_GET": "false"}).s3_config()
    assert on is not None and on.direct_get
    assert off is not None and not off.direct_get and not off.reads_direct()


def test_the_s3_secret_comes_from_a_file_and_the_stronger_source_wins(tmp_path):
    """Branches: a secret file's one line is the secret; a file flag beats a secret in
    the environment (and the reverse); both from one source, an empty or unreadable file
    are ConfigErrors naming the setting."""
    secret = tmp_path / "secret"
    secret.write_text("from-file\n")
    env = {"KVPACK_S3_ACCESS_KEY": "a", "KVPACK_S3_SECRET_KEY_FILE": str(secret)}
    loaded = Settings.load(env=env)
    assert loaded.s3_secret_key == "from-file" and "from-file" not in repr(loaded)
    with_env_secret = {"KVPACK_S3_ACCESS_KEY": "a", "AWS_SECRET_ACCESS_KEY": "from-env"}
    got = Settings.load(env=with_env_secret, s3_secret_key_file=str(secret))
    assert got.s3_secret_key == "from-file"
    got = Settings.load(env=env, s3_secret_key="from-flag")
    assert got.s3_secret_key == "from-flag"
    with pytest.raises(ConfigError, match="not both") as e:
        Settings.load(env={**env, "KVPACK_S3_SECRET_KEY": "x"})
    assert e.value.name == "s3_secret_key_file"
    secret.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        Settings.load(env=env)
    with pytest.raises(ConfigError, match="cannot read"):
        Settings.load(env={**env, "KVPACK_S3_SECRET_KEY_FILE": str(tmp_path / "none")})


def test_the_example_toml_loads_and_names_every_setting(tmp_path):
    """infra/kvpack.example.toml documents every setting (commented out) and, with the
    comments taken away, is a valid settings file."""
    text = EXAMPLE.read_text()
    for name in Settings.__dataclass_fields__:
        assert f"# {name} =" in text, name
    uncommented = tmp_path / "kvpack.toml"
    lines = [line[2:] if line.startswith("# ") and " = " in line else line
             for line in text.splitlines()]  # fmt: skip
    uncommented.write_text("\n".join(lines))
    # The secret and its file are two ways to give one setting: the example shows both.
    with pytest.raises(ConfigError, match="not both"):
        Settings.load(config_file=uncommented, env={})
    uncommented.write_text("\n".join(x for x in lines if not x.startswith("s3_secret_key_file")))
    s = Settings.load(config_file=uncommented, env={})
    assert s.store_url.is_s3 and s.s3_config().bucket


def test_the_data_dir_is_created_0700_and_a_looser_one_is_tightened(tmp_path):
    fresh = Settings.load(data_dir=tmp_path / "new" / "vault", env={})
    assert fresh.ensure_data_dir().stat().st_mode & 0o777 == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    Settings.load(data_dir=loose, env={}).ensure_data_dir()
    assert loose.stat().st_mode & 0o777 == 0o700


def test_a_secret_on_the_command_line_draws_a_warning_a_file_does_not(tmp_path, capsys):
    import argparse

    from kvpack.commands.common import add_storage_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_storage_arguments(parser)
    secret = tmp_path / "secret"
    secret.write_text("s\n")
    base = ["--data-dir", str(tmp_path / "v"), "--s3-access-key", "a"]
    settings_from_args(parser.parse_args([*base, "--s3-secret-key-file", str(secret)]))
    assert capsys.readouterr().err == ""
    got = settings_from_args(parser.parse_args([*base, "--s3-secret-key", "s"]))
    assert got.s3_secret_key == "s" and "visible to every user" in capsys.readouterr().err
