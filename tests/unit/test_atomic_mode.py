"""Every file a run writes gets the user's umask (SECURITY.md): atomic writes too."""

import os
import stat

from ddprun.protocol.atomic import write_text_atomic


def test_an_atomic_write_gets_the_umask_not_mkstemps_0600(tmp_path):
    old = os.umask(0o027)
    try:
        write_text_atomic(str(tmp_path / "a.json"), "{}")
        plain = tmp_path / "b.log"
        plain.write_text("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640 == stat.S_IMODE(plain.stat().st_mode)
