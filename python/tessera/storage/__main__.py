"""``python -m tessera.storage serve | put | get | clear | stats``: the ``tessera-storage``
command line (the same flags as the binary; ``--help`` lists them)."""

import sys

from tessera._native import storage_cli


def main() -> int:
    return storage_cli(["python -m tessera.storage", *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
