"""`ray start` for the cluster's head (`python -m slipstream.ray_head start --head ...`), with every
directory and file Ray creates kept owner-only.

Ray makes its temp directory and each session's directories world-writable on purpose (chmod 0777, "so
others can use it"), sockets included; under /tmp (the fallback for a long HOME) that lets any local user
into the session. Here its "make shared" step is a no-op and the umask is 077, so the head and every
process it starts (GCS, raylet, dashboard, workers, job drivers) create directories 0700 and files 0600.
"""

from __future__ import annotations

import os
import sys


def keep_private() -> None:
    """Turn Ray's chmod 0777 of the directories it creates into nothing (fails loudly if Ray moved it)."""
    from ray._common import utils

    if not callable(getattr(utils, "try_make_directory_shared", None)):
        raise RuntimeError(
            "ray._common.utils.try_make_directory_shared is gone: update slipstream/ray_head.py"
        )

    def private(directory_path) -> None:
        """The directory stays as the umask made it (owner-only)."""

    utils.try_make_directory_shared = private


def main() -> None:
    os.umask(0o077)
    keep_private()
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *sys.argv[1:]]
    ray_main()


if __name__ == "__main__":
    main()
