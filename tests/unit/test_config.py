"""finsieve/config.py: settings from the environment and flags, and the errors that name a
bad one."""

from __future__ import annotations

import pytest

from finsieve.config import Settings
from finsieve.errors import ConfigError


def test_settings_from_environment_and_flags():
    s = Settings.load({"port": 7000}, env={"FINSIEVE_PORT": "6000", "FINSIEVE_MAX_BATCH": "4",
                                           "FINSIEVE_ENGINES": "a:1, b:2"})
    assert (s.port, s.max_batch, s.engines) == (7000, 4, ("a:1", "b:2"))


@pytest.mark.parametrize(
    ("env", "message"),
    [({"FINSIEVE_PORT": "eighty"}, "FINSIEVE_PORT: 'eighty'"),
     ({"FINSIEVE_ROLE": "boss"}, "expected one of all, engine, gateway"),
     ({"FINSIEVE_MAX_BATCH": "0"}, "FINSIEVE_MAX_BATCH: must be positive"),
     ({"FINSIEVE_ROLE": "gateway"}, "--engine"),
     ({"FINSIEVE_MAX_MESSAGE_BYTES": "300000"}, "FINSIEVE_MAX_MESSAGE_BYTES: at least 337872"),
     ({"FINSIEVE_MAX_MESSAGE_BYTES": "9000000"}, "FINSIEVE_MAX_MESSAGE_BYTES: at most 8388608"),
     ({"FINSIEVE_MIN_PING_INTERVAL_S": "90"}, "must not exceed FINSIEVE_KEEPALIVE_TIME_S"),
     ({"FINSIEVE_MAX_CONNECTION_AGE_S": "-1"}, "must not be negative"),
     ({"FINSIEVE_SLOW_READER_GRACE_S": "0"}, "FINSIEVE_SLOW_READER_GRACE_S: must be positive"),
     ({"FINSIEVE_PREPARE_WORKERS": "-1"}, "FINSIEVE_PREPARE_WORKERS: must not be negative"),
     ({"FINSIEVE_PREPARE_WORKERS": "65"}, "FINSIEVE_PREPARE_WORKERS: at most 64"),
     ({"FINSIEVE_MIXED_TOKENS": "-1"}, "FINSIEVE_MIXED_TOKENS: must not be negative"),
     ({"FINSIEVE_MIXED_TOKENS": "8"}, "FINSIEVE_MIXED_TOKENS: 0 .off., or from 16 to 2048"),
     ({"FINSIEVE_MIXED_TOKENS": "4096", "FINSIEVE_PREFILL_CHUNK": "8192"}, "from 16 to 2048"),
     ({"FINSIEVE_MIXED_TOKENS": "512", "FINSIEVE_PREFILL_CHUNK": "256"},
      "at most FINSIEVE_PREFILL_CHUNK"),
     ({"FINSIEVE_AUDIT_SPOOL_MAX_RECORDS": "-1"}, "FINSIEVE_AUDIT_SPOOL_MAX_RECORDS: must not be negative"),
     ({"FINSIEVE_AUDIT_SPOOL_MAX_BYTES": "4096"}, "FINSIEVE_AUDIT_SPOOL_MAX_BYTES: at least 1048576"),
     ({"FINSIEVE_AUDIT_SPOOL_KEEP_S": "0"}, "FINSIEVE_AUDIT_SPOOL_KEEP_S: must be positive"),
     ({"FINSIEVE_AUDIT_WAITAOF_LOCAL": "maybe"},
      "FINSIEVE_AUDIT_WAITAOF_LOCAL: 'maybe': expected true or false")],
)
def test_bad_settings_name_the_setting(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Settings.load(env=env)


def test_the_redis_url_is_read_from_a_private_file(tmp_path):
    url = "rediss://:hunter2@redis:6380/0"
    path = tmp_path / "redis.url"
    path.write_text(url + "\n")
    path.chmod(0o600)
    assert Settings.load(env={"FINSIEVE_REDIS_URL_FILE": str(path)}).redis_url == url
    with pytest.raises(ConfigError, match="set it or FINSIEVE_REDIS_URL, not both"):
        Settings.load(env={"FINSIEVE_REDIS_URL_FILE": str(path), "FINSIEVE_REDIS_URL": url})
    path.chmod(0o644)
    with pytest.raises(ConfigError) as err:
        Settings.load(env={"FINSIEVE_REDIS_URL_FILE": str(path)})
    assert "FINSIEVE_REDIS_URL_FILE" in str(err.value) and "chmod 600" in str(err.value)
    assert "hunter2" not in str(err.value)
    path.write_bytes("redis://:pässword@redis/0".encode())
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="not a URL") as err:
        Settings.load(env={"FINSIEVE_REDIS_URL_FILE": str(path)})
    assert "pässword" not in str(err.value)
