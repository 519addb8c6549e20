"""Secrets on disk: private directories, 0600 files written atomically, strict reads.

Independent of the settings (which read their URL file through it): a caller passes the
configured path and the state directory."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import structlog

from finsieve.errors import ConfigError

log = structlog.get_logger(__name__)

MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 16384  # room for a PEM private key


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) as 0700; tighten it if it exists with a looser mode."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(path.stat().st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def write_private(path: Path, data: str) -> None:
    """Write a 0600 file atomically (a reader never sees it half written or world-readable)."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_secret(path: Path, setting: str, min_bytes: int = MIN_SECRET_BYTES) -> bytes:
    """A secret file's content, refused when missing, loosely permitted, empty or shorter
    than min_bytes (a key's; a URL holding a password may be shorter).

    The message names the setting and the file, never the content."""
    where = f"{setting} {path}"
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{where}: not a regular file")
    if st.st_mode & 0o077 and not mounted_secret(st):
        raise ConfigError(f"{where}: readable or writable by group or others "
                          f"(mode {stat.S_IMODE(st.st_mode):o}): `chmod 600 {path}`, or "
                          "owned by root and readable by its group alone (0440)")
    if st.st_size > MAX_SECRET_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_SECRET_BYTES} bytes: not a secret file")
    try:
        data = path.read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read: {e.strerror}") from None
    if not data:
        raise ConfigError(f"{where}: the file is empty")
    if len(data) < min_bytes:
        raise ConfigError(f"{where}: holds {len(data)} bytes, at least {min_bytes} are "
                          f"needed (e.g. `openssl rand -hex 32 > {path}`)")
    return data


def mounted_secret(st: os.stat_result) -> bool:
    """A file root owns that its group may read and no one else: how a Kubernetes Secret
    volume holds its files when the pod sets fsGroup (the kubelet adds group read: a
    defaultMode of 0400 becomes 0440, root:fsGroup; kubernetes/kubernetes#57923). Without
    fsGroup they are root's alone, unreadable by a non-root process, so no mode fits
    both rules. PostgreSQL accepts its key file on the same terms (root-owned, 0640 at most)."""
    return st.st_uid == 0 and not st.st_mode & 0o037


def secret_file(configured: str, default: Path, setting: str) -> bytes:
    """The secret of a configured file (which must exist), or of `default`, created with a
    random secret on first use."""
    if configured:
        return read_secret(Path(configured), setting)
    if not default.exists():
        write_private(default, secrets.token_hex(32) + "\n")
        log.info("secret file created", setting=setting, path=str(default))
    return read_secret(default, setting)


# Each secret: its configured file (which must exist), else one in the state directory.
def audit_key(configured: str, state: Path) -> bytes:
    return secret_file(configured, state / "audit.key", "FINSIEVE_AUDIT_KEY_FILE")


def keys_secret(configured: str, state: Path) -> bytes:
    return secret_file(configured, state / "keys.secret", "FINSIEVE_KEYS_SECRET_FILE")


def engine_secret(configured: str, state: Path) -> bytes:
    return secret_file(configured, state / "engine.secret", "FINSIEVE_ENGINE_SECRET_FILE")
