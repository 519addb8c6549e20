"""Which secret files start-up accepts: private to their owner, or a Kubernetes Secret volume's
root-owned, group-readable files (the pod's fsGroup; deploy/k8s mounts them so)."""

from __future__ import annotations

import os

import pytest

from finsieve.errors import ConfigError
from finsieve.secretfiles import mounted_secret, read_secret


def stat_of(uid: int, mode: int) -> os.stat_result:
    """A regular file's stat with this owner and mode (the other fields do not matter here)."""
    return os.stat_result((0o100000 | mode, 0, 0, 1, uid, 0, 64, 0, 0, 0))


@pytest.mark.parametrize("uid, mode, accepted", [
    (0, 0o440, True),  # a Secret volume with fsGroup: defaultMode 0400 becomes 0440
    (0, 0o400, True),
    (0, 0o640, True),
    (0, 0o460, False),  # the group may write
    (0, 0o444, False),  # anyone may read
    (0, 0o441, False),
    (0, 0o450, False),
    (10001, 0o440, False),  # not root's: the owner should have made it 0600
])
def test_a_mounted_secret_is_root_owned_and_readable_by_its_group_alone(uid, mode, accepted):
    assert mounted_secret(stat_of(uid, mode)) is accepted


def test_a_group_readable_key_is_accepted_only_when_root_owns_it(tmp_path):
    path = tmp_path / "audit.key"
    path.write_text("k" * 64)
    path.chmod(0o440)
    if os.geteuid() == 0:  # CI and this machine run as root: the file is root's
        assert read_secret(path, "FINSIEVE_AUDIT_KEY_FILE") == b"k" * 64
        os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError, match="readable or writable by group or others") as err:
        read_secret(path, "FINSIEVE_AUDIT_KEY_FILE")
    assert "owned by root and readable by its group alone" in str(err.value)
    assert "k" * 64 not in str(err.value)
